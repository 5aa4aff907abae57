"""Memory pools: request rows -> token slots, and the token-granular KV pool with its allocator."""
from __future__ import annotations

import ctypes
import sys

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_E4M3_MAX = 448.0
# freed slot runs kept apart before they join the free list: without a bound, a server whose frees
# never exhaust the free list (a large pool, --disable-radix-cache) piles up one tensor per release
_MAX_PENDING_FREES = 1024
# Plain decoding takes each request's KV slots this many positions at a time. One slot per request
# per step, as they come off the free list, puts a batch of B requests' decode tokens B slots
# apart, so attention reads a long decode as scattered rows; runs of 16 it streams. 16 takes most
# of the gain of longer runs (docs/performance.md) for at most 15 slots a running request holds
# ahead of it, which are the first to go when memory is short.
DECODE_SLOT_RUN = 16


def decode_run(next_position: int, last_position: int) -> int:
    """How many slots a request with no slot at `next_position` takes: a run, never past the last
    position it will compute (and at least the one it needs now)."""
    return max(1, min(DECODE_SLOT_RUN, last_position + 1 - next_position))


class ReqToTokenPool:
    """One row per running request; row r holds the KV slot index of each of its tokens."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        self.size = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=device)
        self._free_rows: list[int] = list(range(max_reqs))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise RuntimeError(f"request pool row {row} is out of range")
        if row in self._free_rows:  # rows are few, so the membership scan is cheap
            raise RuntimeError(f"request pool row {row} freed twice")
        self._free_rows.append(row)

    def clear(self) -> None:
        self._free_rows = list(range(self.size))


class TokenAllocator:
    """Free list over KV slots 1..size; slot 0 is a dummy that padded writes may target."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        self.size = size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._is_free = torch.ones(self.size + 1, dtype=torch.bool)
        self._is_free[0] = False
        self._pending: list[torch.Tensor] = []
        self._pending_len = 0  # slots in _pending: available_size() runs several times a step

    def available_size(self) -> int:
        return len(self._free) + self._pending_len

    def alloc(self, need: int) -> torch.Tensor | None:
        if need > len(self._free) and self._pending:
            self._merge_pending()
        if need > len(self._free):
            return None
        out, self._free = self._free[:need], self._free[need:]
        self._is_free[out] = False
        return out.to(self.device, non_blocking=True) if str(self.device) != "cpu" else out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to("cpu", dtype=torch.int64).clone()  # callers often pass views of reusable rows
        if bool((slots == 0).any()):
            raise RuntimeError("KV slot 0 (the dummy slot) was freed")
        if bool(self._is_free[slots].any()) or slots.unique().numel() != slots.numel():
            raise RuntimeError("KV slot freed twice")
        self._is_free[slots] = True
        self._pending.append(slots)
        self._pending_len += len(slots)
        if len(self._pending) >= _MAX_PENDING_FREES:
            self._merge_pending()

    def _merge_pending(self) -> None:
        self._free = torch.cat([self._free, *self._pending])
        self._pending, self._pending_len = [], 0


class KVPool:
    """Per-layer K and V buffers of shape [num_slots + 1, num_kv_heads, head_dim], in `dtype`: the
    model's, or fp8 (--kv-cache-dtype) that attention widens back to the model dtype as it reads."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.size = size
        self.dtype = dtype
        self._layout = (num_layers, (size + 1, num_kv_heads, head_dim), torch.device(device))
        self.resume()

    @property
    def released(self) -> bool:
        return not self.k_buffer

    def release(self) -> None:
        """Drop the buffers (release_memory_occupation); what they held is gone."""
        self.k_buffer, self.v_buffer = [], []

    def resume(self) -> None:
        """(Re)allocate the buffers, zeroed."""
        num_layers, shape, device = self._layout
        dtype = self.dtype
        if device.type == "cpu":
            # one allocation on huge pages: decode attention streams the whole pool every step,
            # and with 4 KiB pages an eighth of its time went to TLB misses and restarted prefetch
            layer_elems = shape[0] * shape[1] * shape[2]
            layers = _huge_page_tensor(2 * num_layers * layer_elems, dtype).view(2 * num_layers, *shape)
            self.k_buffer, self.v_buffer = list(layers[:num_layers]), list(layers[num_layers:])
        else:
            self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V, rounded to the pool's dtype (a no-op unless it is narrower, like fp8)."""
        if self.dtype == k.dtype:
            self.k_buffer[layer_id][loc] = k
            self.v_buffer[layer_id][loc] = v
            return
        if self.dtype == torch.float8_e4m3fn:  # no infinities: out-of-range values would turn to NaN
            k, v = k.clamp(-_E4M3_MAX, _E4M3_MAX), v.clamp(-_E4M3_MAX, _E4M3_MAX)
        # as bytes: index_put is not implemented for fp8 on every device
        self.k_buffer[layer_id].view(torch.uint8)[loc] = k.to(self.dtype).view(torch.uint8)
        self.v_buffer[layer_id].view(torch.uint8)[loc] = v.to(self.dtype).view(torch.uint8)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def _huge_page_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose 2 MiB-aligned interior is advised onto transparent huge pages
    (Linux with THP in `madvise` or `always` mode; elsewhere a plain zeroed tensor). The advice
    must come before the first write, which is what places pages."""
    element = torch.tensor([], dtype=dtype).element_size()
    flat = torch.empty(numel + _HUGE_PAGE // element, dtype=dtype)  # room to start on a boundary
    start = -flat.data_ptr() % _HUGE_PAGE // element
    tensor = flat[start:start + numel]
    if sys.platform == "linux":
        length = numel * element // _HUGE_PAGE * _HUGE_PAGE
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return tensor.zero_()

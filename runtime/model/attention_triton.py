"""Triton attention backend: the TorchAttnBackend contract, run by the paged Triton kernels.

init_forward turns the request-to-token table into flat CSR metadata (kv_indptr / kv_indices)
once per pass with device-side torch ops; all sizes come from the batch's host-side length lists,
so neither init_forward nor forward waits on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.kernels.decode_attention import decode_attention_fwd, num_kv_splits
from tandem.kernels.extend_attention import extend_attention_fwd
from tandem.kernels.kv_store import store_kv
from tandem.runtime.cache.pools import KVPool, ReqToTokenPool
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode


@dataclass
class TritonAttnMeta:
    decode: bool
    kv_indptr: torch.Tensor  # [bs + 1] int64; keys of request b: kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [total keys] int64 pool slots
    qo_indptr: torch.Tensor | None  # extend: [bs + 1] int64 offsets of each request's new tokens
    max_extend_len: int
    num_splits: torch.Tensor | None  # decode: [bs] int64, 1..max_splits
    max_splits: int
    kv_lens: torch.Tensor | None = None  # an extend run as decode queries: [tokens] keys each
    query_lens: list[int] = field(default_factory=list)  # decode: each query's keys (host), for windows' splits
    window_splits: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)  # window -> splits, max


def _to_device(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy for all small per-pass int lists (pinned, so it does not block)."""
    host = torch.tensor([x for part in parts for x in part], dtype=torch.int64,
                        pin_memory=device.type == "cuda")
    return list(host.to(device, non_blocking=True).split([len(part) for part in parts]))


def _offsets(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def gather_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor,
                      kv_indptr: torch.Tensor, total: int) -> torch.Tensor:
    """Row r's first lens[b] slots for each request b, concatenated; `total` (host) avoids a sync."""
    rows = torch.repeat_interleave(req_pool_indices, lens, output_size=total)
    starts = torch.repeat_interleave(kv_indptr[:-1], lens, output_size=total)
    cols = torch.arange(total, device=req_to_token.device) - starts
    return req_to_token[rows, cols]


class TritonAttnBackend:
    """Decode: split-KV flash decoding. Extend: prefix from the pool + causal self-attention, or,
    with `deterministic_extend` (--enable-deterministic-inference), each new token as a decode
    query of its own over its request's first prefix + i + 1 keys.

    Invariant: decode splits a request's keys by its own length, so a request gets the same bits in
    any batch. With deterministic_extend a token at length p is also computed as a decode step at
    p computes it, whether it came whole, in chunks or over a cached prefix (the flash extend
    reduces over the prefix and the new tokens in another order)."""

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, *, min_split_len: int = 256,
                 max_kv_splits: int = 16, deterministic_extend: bool = False) -> None:
        self.deterministic_extend = deterministic_extend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.min_split_len = min_split_len
        self.max_kv_splits = max_kv_splits
        num_kv_heads = kv_pool.k_buffer[0].shape[1] if kv_pool.k_buffer else 1
        self.num_kv_heads = num_kv_heads

    def init_forward(self, batch: ForwardBatch) -> None:
        device = self.req_to_token.device
        decode = batch.mode == ForwardMode.DECODE
        if decode and batch.num_tokens != batch.batch_size:
            raise ValueError(f"decode batch has {batch.num_tokens} tokens for {batch.batch_size} requests")
        if not decode and self.deterministic_extend:
            batch.attn_metadata = self._extend_as_decode(batch)
            return
        kv_lens = batch.seq_lens_cpu if decode else batch.prefix_lens_cpu
        kv_offsets = _offsets(kv_lens)
        if decode:
            # splits by each request's own length, never by the batch: a request gets the same bits
            # alone or in any batch (deterministic by default; SGLang fixes its split size only
            # under --enable-deterministic-inference)
            splits = num_kv_splits(kv_lens, self.num_kv_heads, min_split_len=self.min_split_len,
                                   max_splits=self.max_kv_splits, target_programs=None)
            kv_indptr, lens, num_splits = _to_device([kv_offsets, kv_lens, splits], device)
            qo_indptr, max_extend, max_splits = None, 1, max(splits)
        else:
            kv_indptr, lens, qo_indptr = _to_device([kv_offsets, kv_lens, _offsets(batch.extend_lens_cpu)], device)
            num_splits, max_extend, max_splits = None, max(batch.extend_lens_cpu), 0
        kv_indices = gather_kv_indices(self.req_to_token, batch.req_pool_indices.to(device), lens, kv_indptr,
                                       kv_offsets[-1])
        batch.attn_metadata = TritonAttnMeta(decode, kv_indptr, kv_indices, qo_indptr, max_extend, num_splits,
                                             max_splits, query_lens=list(kv_lens) if decode else [])

    def _extend_as_decode(self, batch: ForwardBatch) -> TritonAttnMeta:
        """Every new token a decode query over its request's slot list, its length its own."""
        seq_lens = [p + e for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)]
        kv_offsets = _offsets(seq_lens)
        token_starts, token_lens = [], []
        for start, prefix, extend in zip(kv_offsets, batch.prefix_lens_cpu, batch.extend_lens_cpu):
            token_starts += [start] * extend
            token_lens += range(prefix + 1, prefix + extend + 1)
        splits = num_kv_splits(token_lens, self.num_kv_heads, min_split_len=self.min_split_len,
                               max_splits=self.max_kv_splits, target_programs=None)
        device = self.req_to_token.device
        kv_indptr, lens, token_indptr, kv_lens, num_splits = _to_device(
            [kv_offsets, seq_lens, token_starts + [kv_offsets[-1]], token_lens, splits], device)
        kv_indices = gather_kv_indices(self.req_to_token, batch.req_pool_indices.to(device), lens, kv_indptr,
                                       kv_offsets[-1])
        return TritonAttnMeta(True, token_indptr, kv_indices, None, 1, num_splits, max(splits), kv_lens,
                              query_lens=token_lens)

    def _splits(self, meta: TritonAttnMeta, window: int) -> tuple[torch.Tensor, int]:
        """Decode splits for a window layer: by each query's keys inside its window (its own
        length, as without one), made once per pass and window."""
        if not window:
            return meta.num_splits, meta.max_splits
        if window not in meta.window_splits:
            splits = num_kv_splits([min(n, window) for n in meta.query_lens], self.num_kv_heads,
                                   min_split_len=self.min_split_len, max_splits=self.max_kv_splits,
                                   target_programs=None)
            [t] = _to_device([splits], self.req_to_token.device)
            meta.window_splits[window] = (t, max(splits))
        return meta.window_splits[window]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float, window: int = 0) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, TritonAttnMeta):
            raise RuntimeError("TritonAttnBackend.forward called before init_forward for this batch")
        k_buffer, v_buffer = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        # the whole batch's K/V first: a prefix read below may be slots this pass is filling (see attention.py)
        if k_buffer.dtype == k.dtype:
            store_kv(k_buffer, v_buffer, batch.out_cache_loc, k, v)
        else:  # an fp8 pool: torch rounds (to nearest even, e4m3 clamped) where the kernels only read
            self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        if meta.decode:
            num_splits, max_splits = self._splits(meta, window)
            return decode_attention_fwd(q, k_buffer, v_buffer, meta.kv_indptr, meta.kv_indices, num_splits,
                                        max_splits, scale, kv_lens=meta.kv_lens, window=window)
        return extend_attention_fwd(q, k, v, k_buffer, v_buffer, meta.qo_indptr, meta.kv_indptr,
                                    meta.kv_indices, meta.max_extend_len, scale, window=window)

"""Attention backends behind one interface, and the torch backend (CPU and reference).

A backend writes the new K/V of a layer into the KV pool at `out_cache_loc`, then attends each
new query over its request's whole sequence read through the request-to-token table, or, in a
layer with a sliding window W, over the last W keys up to itself (transformers' sliding_window:
a query at position p sees keys p - W + 1 .. p). The cpu and triton backends never read a key
before a query's window; the torch backend (the reference) gathers and masks them.

Contract: in every layer, ALL new K/V of the batch are written before ANY request reads the
pool. A request's cached prefix may be slots another request of the same batch is filling in
this very pass (n>1 siblings and shared prompts admitted together reuse each other's prefill).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.runtime.cache.pools import KVPool, ReqToTokenPool
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode


class AttentionBackend(Protocol):
    def init_forward(self, batch: ForwardBatch) -> None:
        """Build per-pass metadata once; every layer of the pass reuses it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float, window: int = 0) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; window: the layer's sliding window (0: none). Returns [T, Hq, D]."""


@dataclass
class _DecodeMeta:
    kv_slots: torch.Tensor  # [bs, max_seq] slot per key position (0 = padding)
    mask: torch.Tensor  # [bs, 1, 1, max_seq] True where the query may attend
    seq: torch.Tensor  # [bs] int64 lengths
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask, built once per pass

    def mask_for(self, window: int) -> torch.Tensor:
        if not window:
            return self.mask
        if window not in self.windowed:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.windowed[window] = self.mask & (key_pos[None, :] >= (self.seq - window)[:, None])[:, None, None, :]
        return self.windowed[window]


@dataclass
class _ExtendSpan:
    q_start: int
    q_end: int
    prefix: int
    kv_slots: torch.Tensor | None  # slots of the whole sequence; None without a cached prefix
    mask: torch.Tensor | None  # [ext, seq] causal mask shifted by the prefix; None = plain causal
    windowed: dict[int, torch.Tensor | None] = field(default_factory=dict)

    def mask_for(self, window: int, device: torch.device) -> torch.Tensor | None:
        """The causal mask narrowed to the last `window` keys of each query (None: plain causal)."""
        ext = self.q_end - self.q_start
        if not window or window >= self.prefix + ext:
            return self.mask
        if window not in self.windowed:
            q_pos = self.prefix + torch.arange(ext, device=device)
            key_pos = torch.arange(self.prefix + ext, device=device)
            self.windowed[window] = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] > q_pos[:, None] - window)
        return self.windowed[window]


class TorchAttnBackend:
    """Decode: one SDPA per layer over keys gathered into [bs, max_seq] (one query each, so padding
    costs little). Extend: one SDPA per request, so ragged prefills never compute padded queries, and
    a request without a cached prefix attends straight over its new K/V without any gather."""

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_pool.req_to_token

    def init_forward(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.DECODE:
            batch.attn_metadata = self._decode_meta(batch)
        else:
            batch.attn_metadata = self._extend_spans(batch)

    def _decode_meta(self, batch: ForwardBatch) -> _DecodeMeta:
        device = batch.input_ids.device
        seq = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64, device=device)
        key_pos = torch.arange(max(batch.seq_lens_cpu), device=device)
        rows = self.req_to_token[batch.req_pool_indices, :len(key_pos)]
        valid = key_pos[None, :] < seq[:, None]
        return _DecodeMeta(torch.where(valid, rows, torch.zeros_like(rows)), valid[:, None, None, :], seq)

    def _extend_spans(self, batch: ForwardBatch) -> list[_ExtendSpan]:
        spans, start = [], 0
        device = batch.input_ids.device
        for i, (pre, ext) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
            slots = mask = None
            if pre:
                slots = self.req_to_token[batch.req_pool_indices[i], :pre + ext]
                mask = torch.ones((ext, pre + ext), dtype=torch.bool, device=device).tril(diagonal=pre)
            spans.append(_ExtendSpan(start, start + ext, pre, slots, mask))
            start += ext
        return spans

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float, window: int = 0) -> torch.Tensor:
        # the whole batch's K/V first: a prefix read below may be slots this pass is filling
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        if batch.mode == ForwardMode.DECODE:
            return self._decode(q, layer_id, batch, scale, window)
        out = torch.empty_like(q)
        k_pool, v_pool = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        for span in batch.attn_metadata:  # type: ignore[union-attr]
            qs = q[span.q_start:span.q_end].transpose(0, 1)[None]
            if span.kv_slots is None:
                ks, vs = k[span.q_start:span.q_end], v[span.q_start:span.q_end]
            else:
                ks, vs = _prefixed(k_pool, span, k), _prefixed(v_pool, span, v)
            mask = span.mask_for(window, q.device)
            o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                               attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=True)
            out[span.q_start:span.q_end] = o[0].transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, scale: float,
                window: int) -> torch.Tensor:
        meta: _DecodeMeta = batch.attn_metadata  # type: ignore[assignment]
        k_all = _read(self.kv_pool.k_buffer[layer_id], meta.kv_slots, q.dtype).transpose(1, 2)  # [bs, Hkv, max_seq, D]
        v_all = _read(self.kv_pool.v_buffer[layer_id], meta.kv_slots, q.dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k_all, v_all, attn_mask=meta.mask_for(window),
                                             scale=scale, enable_gqa=True)
        return out[:, :, 0, :]


def _prefixed(pool: torch.Tensor, span: _ExtendSpan, new: torch.Tensor) -> torch.Tensor:
    """The span's whole sequence: its cached prefix from the pool, then this pass's K/V. From an fp8
    pool only the prefix comes rounded: a pass attends over its own K/V as computed, as it does
    without a prefix and as the Triton kernels do, so a chunk boundary does not round them."""
    if pool.dtype == new.dtype:
        return pool[span.kv_slots]  # the same values in one gather
    prefix_len = len(span.kv_slots) - (span.q_end - span.q_start)
    return torch.cat([_read(pool, span.kv_slots[:prefix_len], new.dtype), new[span.q_start:span.q_end]])


def _read(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `slots` of a pool in `dtype`; an fp8 pool is gathered as bytes (indexing is not
    implemented for fp8 on every device) and widened."""
    if pool.dtype == dtype:
        return pool[slots]
    return pool.view(torch.uint8)[slots].view(pool.dtype).to(dtype)


@dataclass
class _QueryRows:
    """Extend on the cpu backend: each new token as a query of its own, with its request's
    req_to_token row and the length it attends over (its cached prefix, then the new tokens
    up to itself)."""
    req_pool_indices: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [num_tokens] int64


class CpuAttnBackend(TorchAttnBackend):
    """Attention in one C++ op (kernels/csrc) that stores the pass's K/V and reads each request's
    K/V in place through its req_to_token row: no per-layer gather into a padded batch (that copy
    took about a third of a batch-64 decode step). Without a toolchain to build the op, the torch
    path runs (logged).

    Invariant: a query at position p computes the same bits in a decode step, in a prefill whole
    or chunked, in an extend over a cached prefix and in a speculative verify, whatever else is in
    the batch: extend hands each new token to the op as a query of its own over the first p + 1
    slots of its row, and the op computes every query in one arithmetic (bf16 on AMX: tiles of
    one request's tokens share its packed keys, kernels/csrc/attention_amx.h)."""

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool) -> None:
        super().__init__(kv_pool, req_to_token_pool)
        from tandem.kernels.cpu_ops import load_cpu_ops

        self.ops = load_cpu_ops()

    def init_forward(self, batch: ForwardBatch) -> None:
        if self.ops is None:
            super().init_forward(batch)
        elif batch.mode == ForwardMode.DECODE:
            batch.attn_metadata = None  # the op reads req_pool_indices and seq_lens itself
        else:
            batch.attn_metadata = _query_rows(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float, window: int = 0) -> torch.Tensor:
        if self.ops is None:
            return super().forward(q, k, v, layer_id, batch, scale, window)
        rows: _QueryRows | None = batch.attn_metadata  # type: ignore[assignment]
        req_pool_indices, seq_lens = (batch.req_pool_indices, batch.seq_lens) if rows is None else \
            (rows.req_pool_indices, rows.seq_lens)
        return self.ops.decode_attention(q, self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id],
                                         self.req_to_token, req_pool_indices, seq_lens, scale,
                                         k, v, batch.out_cache_loc, window)


def _query_rows(batch: ForwardBatch) -> _QueryRows:
    extend_lens = torch.tensor(batch.extend_lens_cpu, dtype=torch.int64)
    prefix_lens = torch.tensor(batch.prefix_lens_cpu, dtype=torch.int64)
    starts = extend_lens.cumsum(0) - extend_lens  # each request's first token in the pass
    token_req = torch.repeat_interleave(torch.arange(len(extend_lens)), extend_lens)
    index_in_req = torch.arange(int(extend_lens.sum())) - starts[token_req]
    device = batch.req_pool_indices.device
    return _QueryRows(batch.req_pool_indices[token_req.to(device)],
                      (prefix_lens[token_req] + index_in_req + 1).to(device))


def create_attention_backend(name: str, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, *,
                             deterministic_extend: bool = False) -> AttentionBackend:
    """`deterministic_extend` (--enable-deterministic-inference) changes the triton backend only:
    the cpu backend computes extend in decode's arithmetic always."""
    if name == "torch":
        return TorchAttnBackend(kv_pool, req_to_token_pool)
    if name == "cpu":
        return CpuAttnBackend(kv_pool, req_to_token_pool)
    if name == "triton":
        from tandem.runtime.model.attention_triton import TritonAttnBackend  # lazy: imports triton

        return TritonAttnBackend(kv_pool, req_to_token_pool, deterministic_extend=deterministic_extend)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch', 'cpu' or 'triton'")

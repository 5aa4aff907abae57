"""Attention backends behind one interface, and the torch backend (CPU and reference).

A backend writes the new K/V of a layer into the KV pool at `out_cache_loc`, then attends each
new query over its request's whole sequence read through the request-to-token table.

Contract: in every layer, ALL new K/V of the batch are written before ANY request reads the
pool. A request's cached prefix may be slots another request of the same batch is filling in
this very pass (n>1 siblings and shared prompts admitted together reuse each other's prefill).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.runtime.cache.pools import KVPool, ReqToTokenPool
from tandem.runtime.model.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def init_forward(self, batch: ForwardBatch) -> None:
        """Build per-pass metadata once; every layer of the pass reuses it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq, D]."""


@dataclass
class _PaddedMeta:
    kv_slots: torch.Tensor  # [bs, max_seq] slot per key position (0 = padding)
    mask: torch.Tensor  # [bs, 1, max_ext, max_seq] True where a query may attend
    q_dest: torch.Tensor  # [T] flat index into [bs * max_ext] of each new token
    max_ext: int


class TorchAttnBackend:
    """Pads the batch to [bs, max_ext] queries x [bs, max_seq] keys and runs one SDPA per layer."""

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_pool.req_to_token

    def init_forward(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        seq = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64, device=device)
        pre = torch.tensor(batch.prefix_lens_cpu, dtype=torch.int64, device=device)
        ext = torch.tensor(batch.extend_lens_cpu, dtype=torch.int64, device=device)
        max_seq, max_ext = max(batch.seq_lens_cpu), max(batch.extend_lens_cpu)
        key_pos = torch.arange(max_seq, device=device)
        rows = self.req_to_token[batch.req_pool_indices, :max_seq]
        kv_slots = torch.where(key_pos[None, :] < seq[:, None], rows, torch.zeros_like(rows))
        q_pos = pre[:, None] + torch.arange(max_ext, device=device)[None, :]  # absolute position of each query
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < seq[:, None, None])
        starts = torch.arange(len(batch.seq_lens_cpu), device=device) * max_ext
        q_dest = torch.repeat_interleave(starts, ext) + _ragged_arange(ext)
        batch.attn_metadata = _PaddedMeta(kv_slots, mask[:, None], q_dest, max_ext)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        self.kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        meta: _PaddedMeta = batch.attn_metadata  # type: ignore[assignment]
        bs, (num_tokens, hq, d) = batch.batch_size, q.shape
        if bs == 1 and meta.max_ext == num_tokens and num_tokens == batch.seq_lens_cpu[0]:
            # plain prefill of one request: no gather and no padding
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                                 enable_gqa=True)
            return out[0].transpose(0, 1)
        q_pad = q.new_zeros((bs * meta.max_ext, hq, d))
        q_pad[meta.q_dest] = q
        q_pad = q_pad.view(bs, meta.max_ext, hq, d).transpose(1, 2)
        k_all = self.kv_pool.k_buffer[layer_id][meta.kv_slots].transpose(1, 2)  # [bs, Hkv, max_seq, D]
        v_all = self.kv_pool.v_buffer[layer_id][meta.kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(q_pad, k_all, v_all, attn_mask=meta.mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(bs * meta.max_ext, hq, d)[meta.q_dest]


def _ragged_arange(lens: torch.Tensor) -> torch.Tensor:
    """[0..l0), [0..l1), ... concatenated."""
    total = int(lens.sum())
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return torch.arange(total, device=lens.device) - starts


def create_attention_backend(name: str, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool) -> AttentionBackend:
    if name == "torch":
        return TorchAttnBackend(kv_pool, req_to_token_pool)
    if name == "triton":
        from tandem.runtime.model.attention_triton import TritonAttnBackend  # lazy: imports triton

        return TritonAttnBackend(kv_pool, req_to_token_pool)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")

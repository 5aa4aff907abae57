"""Split-KV ("flash decoding") attention for one new query token per request over the paged pool.

Stage 1 runs one program per (request, kv head, head block, split): the q heads that share a kv
head are processed together so each K/V row is loaded once per group, and each split covers a
contiguous piece of the request's keys, writing a partial output and its log-sum-exp (base 2).
Stage 2 merges a request's splits. Long requests get more splits so a small batch still fills
the GPU; the per-request split count is data, so mixed lengths share one launch. With a sliding
window W a query attends to (and its splits cover) only its last W keys: none before is loaded.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import (INDEX_DTYPES, KV_DTYPES, check_dim, check_kv_pool_dtype, check_same_device,
                                    check_tensor, dot_precision, next_pow2)

MAX_HEAD_DIM = 256
MIN_HEAD_BLOCK = 16  # tl.dot needs M >= 16 on GPU; spare rows are masked
MAX_HEAD_BLOCK = 64


def decode_attention_ref(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, scale: float,
                         window: int = 0) -> torch.Tensor:
    """q: [bs, Hq, D]; request b attends to slots kv_indices[kv_indptr[b]:kv_indptr[b+1]] (the pool
    in q's dtype or fp8), or with a window to the last `window` of them."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_buffer.shape[1]
    bounds = kv_indptr.tolist()
    for b in range(q.shape[0]):
        first = max(bounds[b], bounds[b + 1] - window) if window else bounds[b]
        slots = kv_indices[first:bounds[b + 1]]
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def decode_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per loop step: keep a K tile near 16 KiB of registers/shared memory."""
    elt = torch.tensor([], dtype=dtype).element_size()
    return max(16, min(64, 16384 // (next_pow2(head_dim) * elt)))


def num_kv_splits(seq_lens: list[int], num_kv_heads: int, *, min_split_len: int = 256, max_splits: int = 16,
                  target_programs: int | None = 264) -> list[int]:
    """Splits per request: about one per `min_split_len` keys, capped so that a batch that already
    has `target_programs` (request, kv head) pairs is not split further. `target_programs=None`:
    no cap by the batch, so a request's splits (and its bits) depend on its own length alone."""
    if not seq_lens:
        return []
    cap = max_splits if target_programs is None else \
        max(1, min(max_splits, math.ceil(target_programs / (len(seq_lens) * num_kv_heads))))
    return [max(1, min(cap, math.ceil(n / min_split_len))) for n in seq_lens]


@triton.jit(do_not_specialize=["window"])  # one compiled kernel for every window: a runtime value
def _decode_split_kernel(Q, K_buf, V_buf, KvIndptr, KvIndices, KvLens, NumSplits, MidO, MidLse, sm_scale, window,
                         stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                         stride_mob, stride_moh, stride_mos, stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, HAS_LENS: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    split = tl.program_id(2)
    n_splits = tl.load(NumSplits + b)
    if split >= n_splits:
        return
    kv_start = tl.load(KvIndptr + b).to(tl.int64)
    if HAS_LENS:  # queries of one request share its slots, each over its own first kv_len
        kv_len = tl.load(KvLens + b).to(tl.int32)
    else:
        kv_len = (tl.load(KvIndptr + b + 1) - kv_start).to(tl.int32)
    # a window (window > 0) leaves the last `window` keys; the splits divide those
    first = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    # splits start on BLOCK_N boundaries from the first key; trailing splits of a short request may be empty
    split_len = tl.cdiv(tl.cdiv(kv_len - first, n_splits), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, kv_len)

    heads = kv_head * GROUP + (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < (kv_head + 1) * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        mask_n = cols < hi
        slots = tl.load(KvIndices + kv_start + cols, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_buf + slots[None, :] * stride_kbs + kv_head * stride_kbh + offs_d[:, None],
                    mask=mask_d[:, None] & mask_n[None, :], other=0.0).to(q.dtype)  # an fp8 pool widens
        qk = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_buf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # an empty split leaves l_i == 0: store a zero output with lse -inf so the merge ignores it
    nonempty = l_i > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    base = b.to(tl.int64) * stride_mob + heads * stride_moh + split * stride_mos
    tl.store(MidO + base[:, None] + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(MidO, MidLse, NumSplits, O, stride_mob, stride_moh, stride_mos, stride_lb, stride_lh,
                         stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_splits = tl.load(NumSplits + b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    parts = tl.load(MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.sum(weights, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


def _check_args(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                kv_indices: torch.Tensor, num_splits: torch.Tensor, kv_lens: torch.Tensor | None) -> None:
    check_tensor("q", q, 3)
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_tensor(name, t, 3, KV_DTYPES)
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("num_splits", num_splits)):
        check_tensor(name, t, 1, INDEX_DTYPES)
    check_kv_pool_dtype(q.dtype, k_buffer, v_buffer)
    check_same_device(q=q, k_buffer=k_buffer, v_buffer=v_buffer, kv_indptr=kv_indptr, kv_indices=kv_indices)
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"decode attention supports head dim up to {MAX_HEAD_DIM}, got {head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if k_buffer.shape != v_buffer.shape:
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)} and v_buffer {tuple(v_buffer.shape)} differ")
    check_dim("k_buffer", k_buffer, 2, head_dim)
    check_dim("kv_indptr", kv_indptr, 0, bs + 1)
    check_dim("num_splits", num_splits, 0, bs)
    if kv_lens is not None:
        check_tensor("kv_lens", kv_lens, 1, INDEX_DTYPES)
        check_dim("kv_lens", kv_lens, 0, bs)


def decode_attention_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_splits: torch.Tensor,
                         max_splits: int, scale: float, block_n: int | None = None,
                         kv_lens: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """q: [bs, Hq, D] (one token per request); k_buffer/v_buffer: [slots, Hkv, D];
    kv_indptr: [bs + 1]; kv_indices: slot of every key; num_splits: [bs], each in 1..max_splits.
    kv_lens: [bs], when given query b attends over kv_indices[kv_indptr[b]:][:kv_lens[b]] (an
    extend's tokens as queries of their own over one shared slot list). window > 0: each query
    attends to its last `window` keys only (size num_splits by those). Every query must have at
    least one key. Returns [bs, Hq, D] in q's dtype."""
    if window < 0:
        raise ValueError(f"window must be 0 (every key) or positive, got {window}")
    _check_args(q, k_buffer, v_buffer, kv_indptr, kv_indices, num_splits, kv_lens)
    bs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if bs == 0:
        return out
    group = num_heads // k_buffer.shape[1]
    block_h = min(MAX_HEAD_BLOCK, max(MIN_HEAD_BLOCK, next_pow2(group)))
    head_blocks = triton.cdiv(group, block_h)
    block_d = max(16, next_pow2(head_dim))
    block_n = block_n or decode_block_n(head_dim, q.dtype)
    mid_o = torch.empty((bs, num_heads, max_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((bs, num_heads, max_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(bs, k_buffer.shape[1] * head_blocks, max_splits)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, kv_indptr if kv_lens is None else kv_lens, num_splits, mid_o,
        mid_lse, scale, window,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), HAS_LENS=kv_lens is not None, num_warps=4, num_stages=2,
    )
    _decode_merge_kernel[(bs, num_heads)](
        mid_o, mid_lse, num_splits, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=max(2, next_pow2(max_splits)), num_warps=4,
    )
    return out

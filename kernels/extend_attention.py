"""Extend (prefill) attention: each request's new tokens attend to its cached prefix, read from the
paged pool, and causally to themselves, read from the new k/v tensors, with one online softmax
running across both parts. Ragged batches go in one launch: program (request, q head, q block)
exits at once when its block lies past the request's new tokens. With a sliding window W a query
at position p sees keys p - W + 1 .. p: a block starts at its first row's window, so no key
before every row's window is loaded.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import (INDEX_DTYPES, KV_DTYPES, check_dim, check_kv_pool_dtype, check_same_device,
                                    check_same_dtype, check_tensor, dot_precision, next_pow2)

MAX_HEAD_DIM = 256


def extend_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor,
                         v_buffer: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                         kv_indices: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] new tokens; request b owns rows qo_indptr[b]:qo_indptr[b+1]
    and its prefix keys are pool slots kv_indices[kv_indptr[b]:kv_indptr[b+1]]; window > 0: each
    query sees its last `window` keys."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        slots = kv_indices[kv[b]:kv[b + 1]]
        rows = slice(qo[b], qo[b + 1])
        keys = torch.cat([k_buffer[slots].float(), k[rows].float()]).repeat_interleave(group, dim=1)
        vals = torch.cat([v_buffer[slots].float(), v[rows].float()]).repeat_interleave(group, dim=1)
        prefix, ext = len(slots), qo[b + 1] - qo[b]
        q_pos = prefix + torch.arange(ext, device=q.device)
        key_pos = torch.arange(prefix + ext, device=q.device)[None, :]
        allowed = key_pos <= q_pos[:, None]  # [ext, n]
        if window:
            allowed &= key_pos > q_pos[:, None] - window
        scores = torch.einsum("thd,nhd->htn", q[rows].float(), keys) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("htn,nhd->thd", probs, vals).to(q.dtype)
    return out


def extend_config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes by head dim and element size: a K/V tile plus the Q tile must fit shared memory
    with two pipeline stages on any sm80+ part (about 100 KiB)."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"extend attention supports head dim up to {MAX_HEAD_DIM}, got {head_dim}")
    wide = dtype == torch.float32
    if head_dim <= 64:
        block_m, block_n = (64, 32) if wide else (128, 64)
    elif head_dim <= 128:
        block_m, block_n = (64, 32) if wide else (128, 32)
    else:
        block_m, block_n = (32, 32) if wide else (64, 32)
    stages = 1 if wide and head_dim > 128 else 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 8 if block_m >= 128 else 4, "num_stages": stages}


@triton.jit
def _softmax_step(q, k, v, acc, m_i, l_i, allowed, qk_scale, PRECISION: tl.constexpr):
    """Fold one K/V tile (k: [D, N], v: [N, D]) into the running max, sum and output."""
    qk = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # a row with no key allowed yet (a window starts past this tile for it) keeps max -inf:
    # subtract 0 then, so its weights are exp2(-inf) = 0 and not NaN
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(qk - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["window"])  # one compiled kernel for every window: a runtime value
def _extend_kernel(Q, K, V, O, K_buf, V_buf, QoIndptr, KvIndptr, KvIndices, sm_scale, window,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_block_start = tl.program_id(2) * BLOCK_M
    q_start = tl.load(QoIndptr + b).to(tl.int64)
    ext_len = (tl.load(QoIndptr + b + 1) - q_start).to(tl.int32)
    if q_block_start >= ext_len:
        return
    kv_start = tl.load(KvIndptr + b).to(tl.int64)
    prefix_len = (tl.load(KvIndptr + b + 1) - kv_start).to(tl.int32)
    kv_head = head // GROUP

    offs_m = q_block_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext_len
    mask_d = offs_d < HEAD_DIM
    rows = q_start + offs_m
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # a window: the block's first row sees keys from first_row - window + 1 on, later rows later
    # (positions here are the request's: the prefix's keys at 0.., the new tokens from prefix_len)
    q_pos = prefix_len + offs_m
    row_first = tl.where(window > 0, q_pos - window + 1, 0)  # each row's first visible key
    lowest = tl.where(window > 0, tl.maximum(prefix_len + q_block_start - window + 1, 0), 0)
    # cached prefix: every key precedes every new token, so only the length (and a window) bounds it
    for start in range(lowest // BLOCK_N * BLOCK_N, prefix_len, BLOCK_N):
        cols = start + offs_n
        mask_n = (cols < prefix_len) & (cols >= lowest)
        slots = tl.load(KvIndices + kv_start + cols, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_buf + slots[None, :] * stride_kbs + kv_head * stride_kbh + offs_d[:, None],
                    mask=mask_d[:, None] & mask_n[None, :], other=0.0).to(q.dtype)  # an fp8 pool widens
        v = tl.load(V_buf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        allowed = mask_n[None, :] & (cols[None, :] >= row_first[:, None])
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, allowed, qk_scale, PRECISION)

    # new tokens, causal; each row's own key is visible to it, so no row's max stays -inf
    kv_end = tl.minimum(ext_len, q_block_start + BLOCK_M)
    new_lowest = tl.maximum(lowest - prefix_len, 0)
    for start in range(new_lowest // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
        cols = start + offs_n
        mask_n = (cols < ext_len) & (cols >= new_lowest)
        krows = q_start + cols
        k = tl.load(K + krows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                    mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        v = tl.load(V + krows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        allowed = mask_n[None, :] & (cols[None, :] <= offs_m[:, None])
        allowed = allowed & (prefix_len + cols[None, :] >= row_first[:, None])
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, allowed, qk_scale, PRECISION)

    # padding rows past ext_len may see no key through a window: never 0 / 0, though they are not stored
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor,
                v_buffer: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                kv_indices: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 3)
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_tensor(name, t, 3, KV_DTYPES)
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        check_tensor(name, t, 1, INDEX_DTYPES)
    check_same_dtype(q=q, k=k, v=v)
    check_kv_pool_dtype(q.dtype, k_buffer, v_buffer)
    check_same_device(q=q, k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, qo_indptr=qo_indptr,
                      kv_indptr=kv_indptr, kv_indices=kv_indices)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    for name, t in (("k", k), ("v", v)):
        check_dim(name, t, 0, num_tokens)
    for name, t in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_dim(name, t, 1, num_kv_heads)
        check_dim(name, t, 2, head_dim)
    check_dim("kv_indptr", kv_indptr, 0, qo_indptr.shape[0])


def extend_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor,
                         v_buffer: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                         kv_indices: torch.Tensor, max_extend_len: int, scale: float,
                         out: torch.Tensor | None = None, block_m: int | None = None,
                         block_n: int | None = None, window: int = 0) -> torch.Tensor:
    """See extend_attention_ref for the layout. `max_extend_len` (host int) sizes the grid and
    must be >= every request's new-token count. Returns [T, Hq, D] in q's dtype."""
    if window < 0:
        raise ValueError(f"window must be 0 (every key) or positive, got {window}")
    _check_args(q, k, v, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must match q: {tuple(out.shape)} {out.dtype} vs {tuple(q.shape)} {q.dtype}")
    num_tokens, num_heads, head_dim = q.shape
    bs = qo_indptr.shape[0] - 1
    if num_tokens == 0 or bs == 0 or max_extend_len <= 0:
        return out
    cfg = extend_config(head_dim, q.dtype)
    cfg["BLOCK_M"] = block_m or cfg["BLOCK_M"]
    cfg["BLOCK_N"] = block_n or cfg["BLOCK_N"]
    grid = (bs, num_heads, triton.cdiv(max_extend_len, cfg["BLOCK_M"]))
    _extend_kernel[grid](
        q, k, v, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, scale, window,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        PRECISION=dot_precision(q.dtype), **cfg,
    )
    return out

"""Neox-style rotary embedding (rotate halves) applied to q and k in place.

`cos_sin` is `RotaryEmbedding.cos_sin`: [max_position, head_dim] = cat[cos, sin] over the half
dim, float32. The math runs in float32 and rounds once, as the torch path does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import INDEX_DTYPES, check_dim, check_same_device, check_same_dtype, check_tensor, next_pow2
from tandem.kernels import reference


rotary_ref = reference.rotary  # out of place, the torch path that serves: returns rotated (q, k)


@triton.jit
def _rotate_heads(X, stride_h, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    ptr1 = X + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptr1, (a * cos[None, :] - b * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(ptr1 + HALF, (b * cos[None, :] + a * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Positions, CosSin, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(CosSin + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, stride_qh, NUM_Q_HEADS, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(K + t * stride_kt, stride_kh, NUM_K_HEADS, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (views of a fused qkv are fine) and returns them.

    Positions are not range-checked against cos_sin (that would need a device sync).
    """
    check_tensor("q", q, 3)
    check_tensor("k", k, 3)
    check_tensor("cos_sin", cos_sin, 2)
    check_tensor("positions", positions, 1, INDEX_DTYPES, last_contiguous=False)
    check_same_dtype(q=q, k=k)
    check_same_device(positions=positions, q=q, k=k, cos_sin=cos_sin)
    num_tokens, head_dim = q.shape[0], q.shape[2]
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {head_dim}")
    check_dim("k", k, 0, num_tokens)
    check_dim("k", k, 2, head_dim)
    check_dim("positions", positions, 0, num_tokens)
    check_dim("cos_sin", cos_sin, 1, head_dim)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q, k, positions.contiguous(), cos_sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos_sin.stride(0), NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=half,
            BLOCK_HQ=next_pow2(q.shape[1]), BLOCK_HK=next_pow2(k.shape[1]), BLOCK_HALF=next_pow2(half),
            num_warps=4,
        )
    return q, k

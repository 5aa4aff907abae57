"""Write a layer's new K and V rows into the paged KV pool at `loc` (one slot per token)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import INDEX_DTYPES, check_dim, check_same_device, check_same_dtype, check_tensor, next_pow2


def store_kv_ref(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    k_buffer[loc] = k
    v_buffer[loc] = v


@triton.jit
def _store_kv_kernel(K, V, K_buf, V_buf, Loc,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(K_buf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :], k, mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(V_buf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :], v, mask=mask)


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buffer/v_buffer: [slots, Hkv, D]; loc: [T] slot ids; k, v: [T, Hkv, D] (any token/head strides)."""
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("k", k), ("v", v)):
        check_tensor(name, t, 3)
    check_tensor("loc", loc, 1, INDEX_DTYPES, last_contiguous=False)
    check_same_dtype(k_buffer=k_buffer, v_buffer=v_buffer, k=k, v=v)
    check_same_device(k_buffer=k_buffer, v_buffer=v_buffer, loc=loc, k=k, v=v)
    num_tokens, num_heads, head_dim = k.shape
    check_dim("loc", loc, 0, num_tokens)
    for name, t in (("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        check_dim(name, t, 1, num_heads)
        check_dim(name, t, 2, head_dim)
    check_dim("v", v, 0, num_tokens)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, loc.contiguous(),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )

"""Weight-only quantized linears in Triton: `x @ W.T` with W stored as group-wise int4 (w4a16) or
per-channel int8 (w8a16), dequantized tile by tile in registers, never as a whole matrix.
Activations are fp16, bf16 or fp32; products and sums are in fp32; the output is x's dtype.

Layouts: kernels/dequant_reference.py (int4 packed 8 per int32 along K, GPTQ's qweight/qzeros;
int8 [N, K] with one scale per output feature). That file's `dequant_linear_ref` is the reference.

Arithmetic. int4: a K block lies in one group, so the block's dot takes x and the integers
(q - zero), exactly representable in every activation dtype, sums in fp32, and then scales the
partial by the group's scale in fp32: one rounding per group partial, none on the weights. int8: x
times q (q exact in every activation dtype), fp32 sums over all of K, times the feature's scale
once at the end.

Batch invariance: one program owns a block of rows and features and walks K from 0 up in fixed
blocks; block sizes depend on the weight and dtype, never on the row count, and there is no split
over K. A row's output bits therefore do not depend on the other rows nor on how many there are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import FLOAT_DTYPES, check_dim, check_same_device, check_tensor, dot_precision
from tandem.kernels.dequant_reference import INT4_GROUP_SIZES, dequant_linear_ref  # the reference, beside its kernel

BLOCK_M, BLOCK_N = 16, 64


@triton.jit
def _w4a16_kernel(X, QW, S, Z, Out, M, N, K, stride_xm, stride_qk, stride_sg, stride_zg, stride_om,
                  GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Out[m, n] = sum_g S[g, n] * sum_{k in g} X[m, k] (q[k, n] - zero[g, n]); BLOCK_K divides GROUP."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    shifts = ((offs_k % 8) * 4)[:, None]  # k0 is a multiple of 8: nibble k % 8 of word k // 8
    rows = offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(X + rows + ks[None, :], mask=mask_m[:, None], other=0.0)
        words = tl.load(QW + (ks // 8).to(tl.int64)[:, None] * stride_qk + offs_n[None, :], mask=mask_n[None, :],
                        other=0)
        q = (words >> shifts) & 0xF
        g = k0 // GROUP
        scale = tl.load(S + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero_words = tl.load(Z + g * stride_zg + offs_n // 8, mask=mask_n, other=0)
            b = q - ((zero_words >> ((offs_n % 8) * 4)) & 0xF)[None, :]
        else:
            b = q - 8
        part = tl.dot(a, b.to(X.dtype.element_ty), input_precision=PRECISION)
        acc += part * scale[None, :]
    tl.store(Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w8a16_kernel(X, QW, S, Out, M, N, K, stride_xm, stride_qn, stride_om, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Out[m, n] = S[n] * sum_k X[m, k] QW[n, k]."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)[:, None] * stride_xm
    cols = offs_n.to(tl.int64)[None, :] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        a = tl.load(X + rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        q = tl.load(QW + cols + ks[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(a, q.to(X.dtype.element_ty), acc, input_precision=PRECISION)
    acc = acc * tl.load(S + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _check_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group_size: int) -> tuple[int, int]:
    """(K, N) of an int4 weight in the layout of kernels/dequant_reference.py."""
    check_tensor("qweight", qweight, 2, (torch.int32,))
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} for bits=4, got {group_size}")
    if k % group_size:
        raise ValueError(f"qweight holds K={k} inputs: K must be a multiple of group_size={group_size}")
    check_tensor("scales", scales, 2)
    check_dim("scales", scales, 0, k // group_size)
    check_dim("scales", scales, 1, n)
    if zeros is not None:
        check_tensor("zeros", zeros, 2, (torch.int32,))
        if n % 8:
            raise ValueError(f"zeros packs 8 features a word: N={n} must be a multiple of 8")
        check_dim("zeros", zeros, 0, k // group_size)
        check_dim("zeros", zeros, 1, n // 8)
    return k, n


def _check_w8(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group_size: int) -> tuple[int, int]:
    """(K, N) of a per-channel int8 weight [N, K]."""
    check_tensor("qweight", qweight, 2, (torch.int8,))
    if zeros is not None:
        raise ValueError("zeros must be None for bits=8 (symmetric per-channel int8)")
    if group_size != -1:
        raise ValueError(f"group_size must be -1 (one scale per output feature) for bits=8, got {group_size}")
    n, k = qweight.shape
    check_tensor("scales", scales, 1)
    check_dim("scales", scales, 0, n)
    return k, n


def dequant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   group_size: int, bits: int) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W the dequantized weight (bits 4: group-wise
    int4, group_size 32/64/128, zeros packed or None; bits 8: per-channel int8, zeros None,
    group_size -1)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    k, n = (_check_w4 if bits == 4 else _check_w8)(qweight, scales, zeros, group_size)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}] (qweight's K), got shape "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    x2 = x.reshape(-1, k)
    check_tensor("x", x2, 2, FLOAT_DTYPES)
    check_same_device(x=x, qweight=qweight, scales=scales, **({"zeros": zeros} if zeros is not None else {}))
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        precision = dot_precision(x.dtype)
        if bits == 4:
            _w4a16_kernel[grid](x2, qweight, scales, zeros if zeros is not None else qweight, out, m, n, k,
                                x2.stride(0), qweight.stride(0), scales.stride(0),
                                zeros.stride(0) if zeros is not None else 0, out.stride(0), GROUP=group_size,
                                HAS_ZEROS=zeros is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                BLOCK_K=min(group_size, 64), PRECISION=precision, num_warps=4)
        else:
            _w8a16_kernel[grid](x2, qweight, scales, out, m, n, k, x2.stride(0), qweight.stride(0), out.stride(0),
                                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=64, PRECISION=precision, num_warps=4)
    return out.view(*x.shape[:-1], n)


__all__ = ["dequant_linear", "dequant_linear_ref"]

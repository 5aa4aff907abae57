"""The torch form of the weight-only quantized linears (w4a16, w8a16): the packing into the layout
kernels/dequant_gemm.py reads, the dequantization back to float, and `x @ W.T` on the dequantized
weight, what the Triton kernel is checked against. Torch only, no triton.

Layouts (N output features, K inputs, G the group size):
- w4a16, group-wise: `qweight` [K/8, N] int32, input k of column n in nibble k % 8 (bits 4(k % 8)
  up) of word [k // 8, n], GPTQ's qweight; `scales` [K/G, N] float; `zeros` None (symmetric: zero
  8) or [K/G, N/8] int32, the zero of column n in nibble n % 8 of word [g, n // 8], GPTQ's qzeros
  holding the zero itself (GPTQ v1 files store zero - 1 and AWQ files interleave the nibbles: a
  loader repacks them). Weight: w[n, k] = scales[k // G, n] * (q[k, n] - zero[k // G, n]).
- w8a16, per output channel: `qweight` [N, K] int8 (nn.Linear's layout), `scales` [N] float,
  no zeros, group size -1. Weight: w[n, k] = scales[n] * q[n, k].
"""
from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128)
SYMMETRIC_ZERO = 8  # the zero of int4 weights stored without zeros


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[R, C] integers in 0..15 -> [R / 8, C] int32: row r in nibble r % 8 of word [r // 8, c]."""
    if q.dim() != 2 or q.shape[0] % 8:
        raise ValueError(f"q must be [R, C] with R a multiple of 8, got shape {tuple(q.shape)}")
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError("q must hold int4 values 0..15")
    nibbles = q.to(torch.int64).view(q.shape[0] // 8, 8, q.shape[1])
    shifts = (4 * torch.arange(8, device=q.device)).view(1, 8, 1)
    words = (nibbles << shifts).sum(dim=1)  # 0 .. 2^32 - 1
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: [R / 8, C] int32 -> [R, C] int32 in 0..15."""
    shifts = (4 * torch.arange(8, device=packed.device, dtype=torch.int32)).view(1, 8, 1)
    nibbles = (packed[:, None, :] >> shifts) & 0xF
    return nibbles.reshape(packed.shape[0] * 8, packed.shape[1])


def pack_int4_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """[K/G, N] zeros in 0..15 -> [K/G, N/8] int32, column n in nibble n % 8 of word [g, n // 8]."""
    return pack_int4(zeros.t().contiguous()).t().contiguous()


def unpack_int4_zeros(packed: torch.Tensor) -> torch.Tensor:
    return unpack_int4(packed.t().contiguous()).t().contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight W [N, K] in `dtype` (each element one rounding of an exact product when
    `dtype` is at least as wide as `scales`)."""
    scales = scales.to(dtype)
    if bits == 8:
        return qweight.to(dtype) * scales[:, None]
    q = unpack_int4(qweight).to(dtype)  # [K, N]
    zero = (unpack_int4_zeros(zeros).to(dtype) if zeros is not None
            else torch.full_like(scales, SYMMETRIC_ZERO))  # [K/G, N]
    w = (q - zero.repeat_interleave(group_size, dim=0)) * scales.repeat_interleave(group_size, dim=0)
    return w.t().contiguous()


def dequant_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       group_size: int, bits: int) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype: W dequantized to float32 (float64 for float64 x)
    and multiplied in that type."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize(qweight, scales, zeros, group_size, bits, compute)
    return (x.to(compute) @ w.t()).to(x.dtype)


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest group-wise int4 of a float W [N, K] (the test and bench weights):
    (qweight, scales [K/G, N] float32, zeros or None) in the layout above."""
    n, k = w.shape
    groups = w.t().float().reshape(k // group_size, group_size, n)
    if symmetric:
        scales = (groups.abs().amax(dim=1) / 7).clamp_min(1e-8)
        zero = torch.full_like(scales, SYMMETRIC_ZERO)
    else:
        lo, hi = groups.amin(dim=1).clamp_max(0), groups.amax(dim=1).clamp_min(0)
        scales = ((hi - lo) / 15).clamp_min(1e-8)
        zero = (-lo / scales).round().clamp(0, 15)
    q = (groups / scales[:, None] + zero[:, None]).round().clamp(0, 15).reshape(k, n)
    packed_zeros = None if symmetric else pack_int4_zeros(zero.to(torch.int32))
    return pack_int4(q.to(torch.int32)), scales, packed_zeros


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric per-channel int8 of W [N, K]: (qweight [N, K] int8, scales [N] float32)."""
    scales = (w.float().abs().amax(dim=1) / 127).clamp_min(1e-8)
    return (w.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales

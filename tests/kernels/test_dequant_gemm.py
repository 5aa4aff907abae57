"""The Triton weight-only quantized linears (kernels/dequant_gemm.py: w4a16 group-wise, w8a16
per-channel) against the torch reference (kernels/dequant_reference.py) evaluated in float64, on
CPU under Triton's interpreter in fp32 and fp16 (its bf16 is broken; a GPU adds bf16); a row's
bits alone and among 1..64 rows; the packed layout; the argument checks."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.dequant_gemm import dequant_linear
from tandem.kernels.dequant_reference import (SYMMETRIC_ZERO, dequant_linear_ref, dequantize, pack_int4,
                                              pack_int4_zeros, quantize_int4, quantize_int8, unpack_int4,
                                              unpack_int4_zeros)

pytestmark = pytest.mark.timeout(300)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
SMALLEST_HALF_ULP = {torch.float32: 0.0, torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}


def _w4(n: int, k: int, group: int, symmetric: bool, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qweight, scales, zeros = quantize_int4(torch.randn(n, k, generator=g), group, symmetric)
    to = (lambda t: t.to(DEV) if t is not None else None)
    return to(qweight), to(scales.to(dtype)), to(zeros)


def _w8(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    qweight, scales = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return qweight.to(DEV), scales.to(dtype).to(DEV)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def _assert_within_rounding(out: torch.Tensor, x: torch.Tensor, qweight, scales, zeros, group: int, bits: int):
    """Elementwise against float64: the kernel's products are exact for 16-bit activations (int4
    minus zero or int8 times an 11-bit mantissa fits fp32), and each output element passes through
    at most K + 2 fp32 roundings (the products and K sums, the group scale, the block sums), so
    |err| <= gamma_{K+2} * (|x| @ |W|.T) (Higham's bound), doubled since an MMA unit may truncate
    rather than round; then one rounding to the output dtype: u_out * |y| (+ half the smallest
    subnormal step)."""
    k = x.shape[-1]
    want = dequant_linear_ref(x.double(), qweight, scales, zeros, group, bits)
    w_abs = dequantize(qweight, scales, zeros, group, bits, torch.float64).abs()
    u32, u_out = 2.0 ** -24, UNIT_ROUNDOFF[out.dtype]
    gamma = (k + 2) * u32 / (1 - (k + 2) * u32)
    acc_bound = 2 * gamma * (x.double().abs() @ w_abs.t())
    bound = acc_bound + u_out * (want.abs() + acc_bound) + SMALLEST_HALF_ULP[out.dtype]
    err = (out.double() - want).abs()
    assert out.dtype == x.dtype and out.shape == want.shape
    assert (err <= bound).all(), f"max err {err.max().item():.3e}, worst excess {(err - bound).max().item():.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group, symmetric", [(32, False), (64, True), (128, False), (128, True)])
@pytest.mark.parametrize("m, n", [(1, 64), (7, 128), (37, 72)])  # 72: N a multiple of 8, not of the block
def test_w4a16_matches_the_reference(dtype, group, symmetric, m, n):
    qweight, scales, zeros = _w4(n, 2 * group, group, symmetric, dtype)
    assert (zeros is None) == symmetric
    x = _x(m, 2 * group, dtype)
    _assert_within_rounding(dequant_linear(x, qweight, scales, zeros, group, 4), x, qweight, scales, zeros, group, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (7, 128, 100), (37, 72, 200)])  # K not a multiple of the block
def test_w8a16_matches_the_reference(dtype, m, n, k):
    qweight, scales = _w8(n, k, dtype)
    x = _x(m, k, dtype)
    _assert_within_rounding(dequant_linear(x, qweight, scales, None, -1, 8), x, qweight, scales, None, -1, 8)


def test_the_check_is_sharp_enough_to_see_a_wrong_zero():
    """Zeros off by one in a single group move the output far outside the stated bound."""
    qweight, scales, zeros = _w4(64, 128, 64, False, torch.float32)
    wrong = unpack_int4_zeros(zeros.cpu())
    wrong[1] = (wrong[1] + 1) % 16
    x = _x(3, 128, torch.float32)
    out = dequant_linear(x, qweight, scales, pack_int4_zeros(wrong).to(DEV), 64, 4)
    with pytest.raises(AssertionError, match="max err"):
        _assert_within_rounding(out, x, qweight, scales, zeros, 64, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_the_same_bits_alone_and_among_1_to_64_rows(dtype, bits):
    if bits == 4:
        qweight, scales, zeros = _w4(72, 128, 32, False, dtype, seed=5)
        args = (qweight, scales, zeros, 32, 4)
    else:
        qweight, scales = _w8(72, 120, dtype, seed=5)
        args = (qweight, scales, None, -1, 8)
    x = _x(64, qweight.shape[0] * 8 if bits == 4 else 120, dtype, seed=6)
    full = dequant_linear(x, *args)
    for m in (1, 2, 7, 16, 17, 33, 63):
        assert torch.equal(dequant_linear(x[:m], *args), full[:m]), m
    for row in (0, 17, 63):
        assert torch.equal(dequant_linear(x[row:row + 1], *args)[0], full[row]), row
    others = _x(40, x.shape[1], dtype, seed=7)  # row 17 at position 5 among different rows
    others[5] = x[17]
    assert torch.equal(dequant_linear(others, *args)[5], full[17])


def test_leading_dims_and_no_rows():
    qweight, scales, zeros = _w4(64, 64, 32, False, torch.float32)
    x = _x(6, 64, torch.float32)
    flat = dequant_linear(x, qweight, scales, zeros, 32, 4)
    assert torch.equal(dequant_linear(x.view(2, 3, 64), qweight, scales, zeros, 32, 4), flat.view(2, 3, 64))
    assert dequant_linear(x[:0], qweight, scales, zeros, 32, 4).shape == (0, 64)


def test_int4_packing_puts_input_k_in_nibble_k_mod_8():
    q = torch.arange(1, 9, dtype=torch.int32).view(8, 1)  # k = 0..7 hold 1..8
    assert pack_int4(q).item() == 0x87654321 - 2 ** 32  # int32 bits 0x87654321
    zeros = torch.arange(8, 16, dtype=torch.int32).view(1, 8)  # features 0..7 hold 8..15
    assert pack_int4_zeros(zeros).item() == 0xFEDCBA98 - 2 ** 32


def test_packing_round_trip_and_dequantize_is_the_integers_times_the_scales():
    g = torch.Generator().manual_seed(2)
    k, n, group = 128, 24, 32
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    zero = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=g) + 0.01
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    assert torch.equal(unpack_int4_zeros(pack_int4_zeros(zero)), zero)
    want = (q - zero.repeat_interleave(group, 0)).float() * scales.repeat_interleave(group, 0)
    assert torch.equal(dequantize(pack_int4(q), scales, pack_int4_zeros(zero), group, 4), want.t())
    symmetric = (q - SYMMETRIC_ZERO).float() * scales.repeat_interleave(group, 0)
    assert torch.equal(dequantize(pack_int4(q), scales, None, group, 4), symmetric.t())
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    assert torch.equal(dequantize(q8, scales[0], None, -1, 8), q8.float() * scales[0][:, None])


@pytest.mark.parametrize("symmetric", [False, True])
def test_round_to_nearest_quantizers_stay_within_half_a_step(symmetric):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    qweight, scales, zeros = quantize_int4(w, 64, symmetric)
    step = scales.repeat_interleave(64, 0).t()
    assert ((dequantize(qweight, scales, zeros, 64, 4) - w).abs() <= step / 2 + 1e-6).all()
    q8, s8 = quantize_int8(w)
    assert ((dequantize(q8, s8, None, -1, 8) - w).abs() <= s8[:, None] / 2 + 1e-6).all()


def test_bad_arguments_are_refused_naming_the_argument():
    qweight, scales, zeros = _w4(64, 128, 64, False, torch.float32)
    q8, s8 = _w8(64, 128, torch.float32)
    x = _x(2, 128, torch.float32)
    cases = [
        ((x, qweight, scales, zeros, 64, 3), ValueError, "bits must be 4 or 8"),
        ((x, q8, scales, zeros, 64, 4), TypeError, "qweight has dtype torch.int8"),
        ((x, qweight, scales, zeros, 48, 4), ValueError, r"group_size must be one of \(32, 64, 128\)"),
        ((x[:, :64], qweight[:8], scales[:1], zeros[:1], 128, 4), ValueError, "K must be a multiple of group_size"),
        ((x, qweight, scales[:, :32], zeros, 64, 4), ValueError, "scales dim 1 must be 64"),
        ((x, qweight, scales[:1], zeros, 64, 4), ValueError, "scales dim 0 must be 2"),
        ((x, qweight, scales, zeros[:, :4], 64, 4), ValueError, "zeros dim 1 must be 8"),
        ((x, qweight, scales, zeros.float(), 64, 4), TypeError, "zeros has dtype"),
        ((x[:, :96], qweight, scales, zeros, 64, 4), ValueError, r"x must be \[\.\.\., 128\]"),
        ((x.to(torch.int32), qweight, scales, zeros, 64, 4), TypeError, "x has dtype torch.int32"),
        ((x, q8, s8, zeros, -1, 8), ValueError, "zeros must be None for bits=8"),
        ((x, q8, s8, None, 64, 8), ValueError, "group_size must be -1"),
        ((x, q8, s8[:, None], None, -1, 8), ValueError, "scales must have 1 dims"),
        ((x, q8, s8[:32], None, -1, 8), ValueError, "scales dim 0 must be 64"),
        ((x, qweight, scales.to(torch.int32), zeros, 64, 4), TypeError, "scales has dtype"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            dequant_linear(*args)
    q_odd, s_odd, z_odd = _w4(64, 128, 64, False, torch.float32)
    with pytest.raises(ValueError, match="N=60 must be a multiple of 8"):
        dequant_linear(x, q_odd[:, :60], s_odd[:, :60], z_odd, 64, 4)

"""The GGUF linear's bf16-tile arithmetic (kernels/csrc/gguf_amx_bf16.h), bf16 activations' path on
a CPU with AMX-BF16: the weights dequantized on the fly to bf16 (gguf's dequantize, rounded once to
bf16) and multiplied by TDPBF16PS. Against float64 of x_bf16 @ W_bf16.T within float32 summation;
bit for bit the dense AMX kernel's answer on the dequantized bf16 weight (the `--quantization none`
bf16 path); a row's bits alone equal its bits among 1 to 300 rows, at 1 and 2 threads. The K-quants
(Q4_K, Q5_K, Q6_K: random super-blocks, as tests/kernels/test_gguf_linear.py builds them) alike."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.runtime.model.quant import gguf_blocks as gb

TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
K_QUANTS = ("q4_k", "q5_k", "q6_k")
SHAPES = [(37, 96), (16, 32), (100, 160), (5, 544), (960, 576)]  # [out, in]: odd tails, and SmolLM2's qkv
K_SHAPES = [(37, 256), (16, 512), (100, 768), (5, 1024), (576, 1536)]  # whole super-blocks; SmolLM2's down_proj
CASES = [(name, n, k) for name in TYPES for n, k in (K_SHAPES if name in K_QUANTS else SHAPES)]


@pytest.fixture(scope="module")
def ops(amx_ops):
    return amx_ops


def _random_k_raw(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A K-quant tensor's file rows: random bytes under fp16 super-block scales of random sign and
    magnitude 1e-4 to 2e-3, one in 16 a subnormal and one in 32 zero (test_gguf_linear.py's)."""
    block_bytes = gb.TYPES[TYPES[name]][1]
    count = n * k // 256
    raw = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    for at in ((208,) if name == "q6_k" else (0, 2)):
        scale = rng.uniform(1e-4, 2e-3, count) * rng.choice([-1.0, 1.0], count)
        scale[rng.random(count) < 1 / 16] *= 1e-3
        scale[rng.random(count) < 1 / 32] = 0.0
        raw[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(count, 2)
    return raw.reshape(n, -1)


def _in(name: str, k: int) -> int:
    return 512 if name in K_QUANTS else k


def _case(name: str, n: int, k: int, seed: int) -> tuple[gb.GgufWeight, torch.Tensor]:
    """A packed weight and its dequantized bf16 [n, k] (gguf's float32 dequantize, rounded once)."""
    rng = np.random.default_rng(seed)
    if name in K_QUANTS:
        raw = _random_k_raw(name, n, k, rng)
    else:
        w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
        raw = gb.quantize_raw(w, TYPES[name])
    return gb.pack(raw, TYPES[name]), torch.from_numpy(gb.dequantize_raw(raw, TYPES[name]).reshape(n, k)).bfloat16()


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 3  # channels of unequal scale
    x[0, :5] = 40.0  # an outlier block
    return x.bfloat16()


@pytest.mark.parametrize("name,n,k", CASES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_float32_sums_of_the_dequantized_bf16_weights(ops, name, n, k, rows):
    """Products of two bf16 are exact in float32; each of the K additions into the float32 sum rounds
    by at most 2^-24 of the running |sum| <= sum |x w|: |out - exact| <= K 2^-24 sum |x w| (and one
    more rounding for the bias). The bf16 output is that sum rounded once to nearest (8 significant bits):
    at most 2^-8 of it more."""
    weight, wb = _case(name, n, k, seed=n * 1000 + k)
    x = _x(rows, k, seed=rows)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)).bfloat16()
    exact = x.double() @ wb.double().T + bias.double()
    bound = (k + 1) * 2.0 ** -24 * (x.double().abs() @ wb.double().abs().T + bias.double().abs())
    sums = gb.linear(x, weight, bias, out_fp32=True, path="amx_bf16")
    assert sums.dtype == torch.float32 and sums.shape == (rows, n)
    assert ((sums.double() - exact).abs() <= bound).all(), ((sums.double() - exact).abs() / bound).max()
    out = gb.linear(x, weight, bias)  # bf16's default path on this CPU
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, gb.linear(x, weight, bias, path="amx_bf16"))
    assert torch.equal(out, sums.bfloat16())  # one rounding of the same sums
    assert ((out.double() - exact).abs() <= bound + (exact.abs() + bound) * 2.0 ** -8).all()


@pytest.mark.parametrize("name,n,k", [c for c in CASES if c[1] % 16 == 0])
def test_bit_for_bit_the_dense_amx_linear_on_the_dequantized_bf16_weight(ops, name, n, k):
    """The dense bf16 path (kernels/csrc/amx_linear_cpu.cpp) sums the same products in the same
    order (TDPBF16PS over K ascending into one float32 tile from zero, bias in float32, one rounding)."""
    weight, wb = _case(name, n, k, seed=n + k)
    x = _x(40, k, seed=5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).bfloat16()
    dense = ops.amx_pack(wb)
    assert torch.equal(gb.linear(x, weight, bias), ops.amx_linear(x, dense, bias))
    assert torch.equal(gb.linear(x, weight, out_fp32=True), ops.amx_linear(x, dense, None, True))


def test_a_q4_1_min_far_from_its_scale_takes_the_other_formula_for_the_same_bits(ops):
    """Q4_1's weight d u + m is computed as fma(16 + u, d, m - 16 d) where m - 16 d is exact in float32,
    else as fma(u, d, m): rows whose min (~1000) dwarfs 16 d (~1e-4) take the second, the rest the first."""
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((48, 128)) * 0.05).astype(np.float32)
    w[5] = 1000 + rng.random(128) * 1e-3
    w[20:23] = -3 + rng.random((3, 128)) * 1e-4
    raw = gb.quantize_raw(w, TYPES["q4_1"])
    blocks = raw.reshape(48, 4, 20)
    d, m = (blocks[..., i:i + 2].copy().view(np.float16).astype(np.float64) for i in (0, 2))
    offset32 = m.astype(np.float32) - 16 * d.astype(np.float32)  # float32, rounded where inexact
    inexact = offset32.astype(np.float64) != m - 16 * d
    assert inexact.any() and not inexact.all()  # both formulas run
    weight = gb.pack(raw, TYPES["q4_1"])
    wb = torch.from_numpy(gb.dequantize_raw(raw, TYPES["q4_1"]).reshape(48, 128)).bfloat16()
    x = _x(9, 128, seed=6)
    assert torch.equal(gb.linear(x, weight, out_fp32=True), ops.amx_linear(x, ops.amx_pack(wb), None, True))


@pytest.mark.parametrize("name", TYPES)
def test_a_row_gets_the_same_bits_among_1_to_300_rows_at_1_and_2_threads(ops, name):
    k = _in(name, 160)
    weight, _ = _case(name, 100, k, seed=9)  # 7 feature blocks: a pair and a lone block
    x = _x(300, k, seed=11)
    alone = torch.cat([gb.linear(x[i:i + 1], weight) for i in range(300)])
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(4)
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(torch.cat([gb.linear(x[i:i + 1], weight) for i in range(0, 300, 7)]), alone[::7])
            for rows in (2, 15, 16, 17, 31, 32, 33, 64, 65, 255, 256, 257, 300):
                chosen = torch.randperm(300, generator=gen)[:rows]
                assert torch.equal(gb.linear(x[chosen], weight), alone[chosen]), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_the_bf16_tile_path_refuses_other_dtypes(ops):
    weight, _ = _case("q4_1", 16, 64, seed=0)
    with pytest.raises(RuntimeError, match="path amx_bf16: x must be bfloat16"):
        gb.linear(torch.randn(2, 64), weight, path="amx_bf16")
    # float32 keeps the integer arithmetic: its answer is the portable kernel's
    x = torch.randn(3, 64)
    assert torch.equal(gb.linear(x, weight), gb.linear(x, weight, path="portable"))

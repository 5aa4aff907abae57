"""The GGUF linear (kernels/csrc/gguf_linear_cpu.cpp) against a float64 reference of the
dequantized weights (gguf's own dequantize), for every block type, odd shapes, batch 1, 7 and 64;
and its determinism: a row's bits alone equal its bits in any batch, at 1 or 2 threads, on the
integer arithmetic's kernels (AMX-INT8, AVX-512 VNNI, portable) and on the bf16-tile one
(tests/kernels/test_gguf_bf16_tiles.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.runtime.model.quant import gguf_blocks as gb

TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8}
SHAPES = [(37, 96), (16, 32), (100, 160), (5, 544)]  # [out, in]: out not a multiple of 16, in an odd number of blocks
QMAX = 32512  # the kernel's 16-bit activation range per block (kQMax)


def _blocks(raw: np.ndarray, name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d, m, q) float64 [n, k] from the file's rows: w = d * q + m (q0 offset folded into q)."""
    bb = {"q4_0": 18, "q4_1": 20, "q8_0": 34}[name]
    blocks = raw.reshape(n, k // 32, bb)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64) if name == "q4_1" else np.zeros_like(d)
    if name == "q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.float64)
    else:
        qs = blocks[..., bb - 16:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64) - (8 if name == "q4_0" else 0)
    return (np.repeat(d, 32, axis=-1).reshape(n, k), np.repeat(m, 32, axis=-1).reshape(n, k), q.reshape(n, k))


def _case(name: str, n: int, k: int, seed: int) -> tuple[gb.GgufWeight, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    raw = gb.quantize_raw(w, TYPES[name])
    return gb.pack(raw, TYPES[name]), raw, gb.dequantize_raw(raw, TYPES[name]).reshape(n, k)


def _bound(x: torch.Tensor, raw: np.ndarray, name: str, n: int, k: int) -> torch.Tensor:
    """|kernel - exact| per element, from the kernel's arithmetic: each input is quantized to
    amax_b / 32512 steps (error <= amax_b / 65024, b its 32-input block), times |w| summed; and the
    float32 part (a product d * dx, a conversion and an fma per block, one more fma for Q4_1's
    min) adds at most (blocks + 3) float32 roundings of the sum of the terms' magnitudes, and Q4_1's
    min multiplies a float32 sum of the block's 32 inputs (31 more roundings)."""
    d, m, q = (torch.from_numpy(a) for a in _blocks(raw, name, n, k))
    xd = x.double()
    amax = xd.abs().view(x.shape[0], k // 32, 32).amax(-1)
    step = (amax / (2 * QMAX)).repeat_interleave(32, dim=1)  # [rows, k]
    w_abs = (d * q + m).abs()
    quantization = step @ w_abs.T
    terms = xd.abs() @ (d.abs() * q.abs()).T + step @ (d.abs() * q.abs()).T
    return quantization + (k // 32 + 3) * 2.0 ** -23 * terms + (k // 32 + 35) * 2.0 ** -23 * (xd.abs() @ m.abs().T)


@pytest.fixture(scope="module")
def ops():
    from tandem.kernels.cpu_ops import load_cpu_ops

    built = load_cpu_ops()
    assert built is not None, "the CPU ops did not build: see the warning logged by load_cpu_ops"
    return built


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_against_float64_of_the_dequantized_weights(ops, name, n, k, rows):
    weight, raw, deq = _case(name, n, k, seed=n * 1000 + k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 3  # channels of unequal scale
    x[0, :5] = 40.0  # an outlier block
    ref = x.double() @ torch.from_numpy(deq).double().T
    bound = _bound(x, raw, name, n, k)
    out = gb.linear(x, weight, out_fp32=True)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= bound).all(), ((out.double() - ref).abs() / bound).max()
    # bf16 activations on the integer arithmetic: the same bound on the bf16 values, then one
    # rounding to bf16 (the bf16-tile arithmetic, bf16's default on AMX: test_gguf_bf16_tiles.py)
    xb = x.to(torch.bfloat16)
    refb = xb.double() @ torch.from_numpy(deq).double().T
    outb = gb.linear(xb, weight, path="amx")
    assert outb.dtype == torch.bfloat16
    assert ((outb.double() - refb).abs() <= _bound(xb.float(), raw, name, n, k) + refb.abs() * 2.0 ** -8).all()


@pytest.mark.parametrize("name", TYPES)
def test_bias_added_in_float32_then_rounded_once(ops, name):
    weight, _, _ = _case(name, 37, 96, seed=1)
    x, bias = torch.randn(5, 96), torch.randn(37)
    base = gb.linear(x, weight, out_fp32=True)
    assert torch.equal(gb.linear(x, weight, bias, out_fp32=True), base + bias)
    assert torch.equal(gb.linear(x.to(torch.bfloat16), weight, bias.to(torch.bfloat16)),
                       (gb.linear(x.to(torch.bfloat16), weight, out_fp32=True) + bias.to(torch.bfloat16).float())
                       .to(torch.bfloat16))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_in_any_batch_at_any_thread_count(ops, name, dtype):
    weight, _, _ = _case(name, 100, 160, seed=7)
    x = (torch.randn(64, 160) * 2).to(dtype)
    batched = gb.linear(x, weight)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for i in (0, 5, 17, 63):
                assert torch.equal(gb.linear(x[i:i + 1], weight), batched[i:i + 1]), (count, i)
            for rows in (7, 9, 33):
                assert torch.equal(gb.linear(x[:rows], weight), batched[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)
    integer = gb.linear(x, weight, path="portable")
    if dtype == torch.float32:
        assert torch.equal(integer, batched)  # float32 takes the integer arithmetic
    for path in ("vnni", "amx"):  # every kernel of the integer arithmetic computes the same sums
        assert torch.equal(gb.linear(x, weight, path=path), integer), path
        assert torch.equal(gb.linear(x[:3], weight, path=path), integer[:3]), path


@pytest.mark.parametrize("name", TYPES)
def test_rows_are_gguf_dequantize_bit_for_bit(ops, name):
    weight, _, deq = _case(name, 37, 96, seed=3)
    ids = torch.tensor([0, 36, 5, 5, 16])
    assert torch.equal(gb.rows(weight, ids), torch.from_numpy(deq[ids.numpy()]))
    with pytest.raises(RuntimeError, match="ids: 37"):
        gb.rows(weight, torch.tensor([37]))


def test_packed_bytes_are_the_files(ops):
    """Repacking moves bytes only: the packed weight is the file's size but for padding to 16 rows."""
    for name, tid in TYPES.items():
        weight, raw, _ = _case(name, 48, 96, seed=0)
        assert weight.nbytes == raw.nbytes and weight.qtype == name and weight.shape == (48, 96)


def test_shapes_the_kernel_cannot_take_are_refused(ops):
    assert not gb.supported(8, (16, 40)) and not gb.supported(12, (16, 256)) and gb.supported(3, (5, 64))
    weight, _, _ = _case("q8_0", 16, 64, seed=0)
    with pytest.raises(RuntimeError, match="64 inputs"):
        gb.linear(torch.randn(2, 32), weight)

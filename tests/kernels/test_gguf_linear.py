"""The GGUF linear (kernels/csrc/gguf_linear_cpu.cpp) against a float64 reference of the
dequantized weights (gguf's own dequantize), for every block type (Q5_0 and Q5_1 by gguf's quantizer), odd shapes, batch 1, 7 and 64;
and its determinism: a row's bits alone equal its bits in any batch, at 1 or 2 threads, on the
integer arithmetic's kernels (AMX-INT8, AVX-512 VNNI, portable) and on the bf16-tile one
(tests/kernels/test_gguf_bf16_tiles.py).

The K-quants (Q4_K, Q5_K, Q6_K), which gguf cannot quantize, are random super-blocks: random scale
and quant bytes under random fp16 super-block scales (some of them fp16 subnormals, some zero)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.runtime.model.quant import gguf_blocks as gb

TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
K_QUANTS = ("q4_k", "q5_k", "q6_k")
SHAPES = [(37, 96), (16, 32), (100, 160), (5, 544)]  # [out, in]: out not a multiple of 16, in an odd number of blocks
K_SHAPES = [(37, 256), (16, 512), (100, 768), (5, 1024)]  # in: whole 256-input super-blocks
CASES = [(name, n, k) for name in TYPES for n, k in (K_SHAPES if name in K_QUANTS else SHAPES)]
QMAX = 32512  # the kernel's 16-bit activation range per block (kQMax)


def _in(name: str, k: int) -> int:
    """An input count the type takes: k, or two super-blocks for a K-quant."""
    return 512 if name in K_QUANTS else k


def _offsets(raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """m float64 [n, k]: the weight's offset (w = d q + m), zeros for the types without one (Q4_1's
    and Q5_1's fp16 m, Q5_0's -16 d; Q4_K's and Q5_K's -dmin * min, by gguf's own scale unpacking)."""
    if name in ("q4_1", "q5_1"):
        m = raw.reshape(n, k // 32, gb.TYPES[TYPES[name]][1])[..., 2:4].copy().view(np.float16).astype(np.float64)
        return np.repeat(m, 32, axis=-1).reshape(n, k)
    if name == "q5_0":  # held as fma(d, u, m) with m = -16 d (the file's d (u - 16))
        d = raw.reshape(n, k // 32, 22)[..., 0:2].copy().view(np.float16).astype(np.float64)
        return np.repeat(-16 * d, 32, axis=-1).reshape(n, k)
    if name in ("q4_k", "q5_k"):
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, gb.TYPES[TYPES[name]][1])
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
        _, mins = Q4_K.get_scale_min(blocks[:, 4:16])
        return np.repeat(-dmin * mins.astype(np.float64), 32, axis=-1).reshape(n, k)
    return np.zeros((n, k))


def random_k_raw(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A K-quant tensor's file rows [n, k / 256 * block bytes]: random bytes, with fp16 super-block
    scales d (and dmin) of random sign and magnitude 1e-4 to 2e-3, one in 16 a subnormal and one in 32 zero."""
    tid = TYPES[name]
    block_bytes = gb.TYPES[tid][1]
    count = n * k // 256
    raw = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    for at in ((208,) if name == "q6_k" else (0, 2)):
        scale = rng.uniform(1e-4, 2e-3, count) * rng.choice([-1.0, 1.0], count)
        scale[rng.random(count) < 1 / 16] *= 1e-3  # fp16 subnormals
        scale[rng.random(count) < 1 / 32] = 0.0
        raw[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(count, 2)
    return raw.reshape(n, -1)


def _case(name: str, n: int, k: int, seed: int) -> tuple[gb.GgufWeight, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name in K_QUANTS:
        raw = random_k_raw(name, n, k, rng)
    else:
        w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
        raw = gb.quantize_raw(w, TYPES[name])
    return gb.pack(raw, TYPES[name]), raw, gb.dequantize_raw(raw, TYPES[name]).reshape(n, k)


def _bound(x: torch.Tensor, raw: np.ndarray, deq: np.ndarray, name: str, n: int, k: int) -> torch.Tensor:
    """|kernel - exact| per element, from the kernel's arithmetic: each input is quantized to
    amax_b / 32512 steps (error <= amax_b / 65024, b its 32-input block), times |d q| = |w - m| summed
    (the min's term takes the block's float32 sum of the unquantized inputs); and the
    float32 part (a product d * dx, a conversion and an fma per block and per scale: Q6_K has two, one
    more fma for a min m) adds at most (blocks * scales + 3) float32 roundings of the sum of the terms'
    magnitudes |x| |d q| (|d q| = |w - m|), and the min multiplies a float32 sum of the block's 32
    inputs (31 more roundings)."""
    m = torch.from_numpy(_offsets(raw, name, n, k))
    w = torch.from_numpy(deq).double()
    xd = x.double()
    amax = xd.abs().view(x.shape[0], k // 32, 32).amax(-1)
    step = (amax / (2 * QMAX)).repeat_interleave(32, dim=1)  # [rows, k]
    dq = (w - m).abs()
    quantization = step @ dq.T
    terms = xd.abs() @ dq.T + step @ dq.T
    roundings = (k // 32) * (2 if name == "q6_k" else 1) + 3
    return quantization + roundings * 2.0 ** -23 * terms + (k // 32 + 35) * 2.0 ** -23 * (xd.abs() @ m.abs().T)


@pytest.fixture(scope="module")
def ops():
    from tandem.kernels.cpu_ops import load_cpu_ops

    built = load_cpu_ops()
    assert built is not None, "the CPU ops did not build: see the warning logged by load_cpu_ops"
    return built


@pytest.mark.parametrize("name,n,k", CASES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_against_float64_of_the_dequantized_weights(ops, name, n, k, rows):
    weight, raw, deq = _case(name, n, k, seed=n * 1000 + k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen) * torch.rand(1, k, generator=gen) * 3  # channels of unequal scale
    x[0, :5] = 40.0  # an outlier block
    ref = x.double() @ torch.from_numpy(deq).double().T
    bound = _bound(x, raw, deq, name, n, k)
    out = gb.linear(x, weight, out_fp32=True)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= bound).all(), ((out.double() - ref).abs() / bound).max()
    # bf16 activations on the integer arithmetic: the same bound on the bf16 values, then one
    # rounding to bf16 (the bf16-tile arithmetic, bf16's default on AMX: test_gguf_bf16_tiles.py)
    xb = x.to(torch.bfloat16)
    refb = xb.double() @ torch.from_numpy(deq).double().T
    outb = gb.linear(xb, weight, path="amx")
    assert outb.dtype == torch.bfloat16
    assert ((outb.double() - refb).abs() <= _bound(xb.float(), raw, deq, name, n, k) + refb.abs() * 2.0 ** -8).all()


@pytest.mark.parametrize("name", TYPES)
def test_bias_added_in_float32_then_rounded_once(ops, name):
    k = _in(name, 96)
    weight, _, _ = _case(name, 37, k, seed=1)
    x, bias = torch.randn(5, k), torch.randn(37)
    base = gb.linear(x, weight, out_fp32=True)
    assert torch.equal(gb.linear(x, weight, bias, out_fp32=True), base + bias)
    assert torch.equal(gb.linear(x.to(torch.bfloat16), weight, bias.to(torch.bfloat16)),
                       (gb.linear(x.to(torch.bfloat16), weight, out_fp32=True) + bias.to(torch.bfloat16).float())
                       .to(torch.bfloat16))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_in_any_batch_at_any_thread_count(ops, name, dtype):
    k = _in(name, 160)
    weight, _, _ = _case(name, 100, k, seed=7)
    x = (torch.randn(64, k) * 2).to(dtype)
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
    weight, _, deq = _case(name, 37, _in(name, 96), seed=3)
    ids = torch.tensor([0, 36, 5, 5, 16])
    assert torch.equal(gb.rows(weight, ids), torch.from_numpy(deq[ids.numpy()]))
    with pytest.raises(RuntimeError, match="ids: 37"):
        gb.rows(weight, torch.tensor([37]))


def test_packed_bytes_are_the_files(ops):
    """Repacking moves bytes only: the packed weight is the file's size but for padding to 16 rows."""
    for name, tid in TYPES.items():
        if tid in gb.UNPACKED:
            continue
        weight, raw, _ = _case(name, 48, 96, seed=0)
        assert weight.nbytes == raw.nbytes and weight.qtype == name and weight.shape == (48, 96)


def test_k_quants_are_unpacked_to_units_of_exact_float32_scales(ops):
    """A K-quant's super-block (file bytes per 256 inputs: 144, 176, 210) becomes 8 units' worth of
    32-input blocks (bytes per 16 x 32: 384, 448, 640), the scales float32 products of the file's."""
    for name, file_bytes, unit_bytes in (("q4_k", 144, 384), ("q5_k", 176, 448), ("q6_k", 210, 640)):
        weight, raw, _ = _case(name, 48, 512, seed=0)
        assert raw.nbytes == 48 * 2 * file_bytes and weight.qtype == name and weight.shape == (48, 512)
        assert weight.packed.shape == (3, 16, unit_bytes)
        assert gb.TYPES[TYPES[name]] == (name, file_bytes, unit_bytes)


def test_q5_0_and_q5_1_become_q5_k_units_of_exact_float32_scales(ops):
    """A Q5_0 / Q5_1 block (22 / 24 bytes per 32 inputs) becomes Q5_K's unit (448 bytes per 16 x 32):
    d and m float32, m = -16 d for Q5_0, so d u + m is the file's weight exactly."""
    for name, file_bytes in (("q5_0", 22), ("q5_1", 24)):
        weight, raw, deq = _case(name, 48, 96, seed=0)
        assert raw.nbytes == 48 * 3 * file_bytes and weight.qtype == name and weight.packed.shape == (3, 3, 448)
        assert torch.equal(gb.rows(weight, torch.arange(48)), torch.from_numpy(deq))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_of_mixed_types_is_its_parts_side_by_side(ops, dtype):
    """A fused linear of parts in several types (gguf_blocks.group): each part's own linear, bias and
    all, its output in the part's columns; a row's bits alone equal its bits batched."""
    parts = [_case(name, n, 96, seed=i)[0] for i, (name, n) in enumerate((("q5_0", 37), ("q4_1", 16), ("q8_0", 21)))]
    weight = gb.group(parts)
    assert weight.shape == (74, 96) and weight.qtype == "q5_0+q4_1+q8_0" and weight.packed.dim() == 1
    x, bias = torch.randn(9, 96).to(dtype), torch.randn(74).to(dtype)
    out = gb.linear(x, weight, bias)
    assert torch.equal(out, torch.cat([gb.linear(x, p, b) for p, b in zip(parts, bias.split([37, 16, 21]))], -1))
    assert torch.equal(gb.linear(x[3:4], weight, bias), out[3:4])
    assert torch.equal(gb.linear(x, weight, out_fp32=True),
                       torch.cat([gb.linear(x, p, out_fp32=True) for p in parts], -1))
    with pytest.raises(RuntimeError, match="packed: gguf pack's"):
        gb.rows(weight, torch.tensor([0]))
    with pytest.raises(ValueError, match="one input count"):
        gb.group([parts[0], _case("q4_0", 16, 64, seed=0)[0]])
    with pytest.raises(RuntimeError, match="features"):
        ops.gguf_linear(x, weight.packed, 73, None, False, 0)


def test_shapes_the_kernel_cannot_take_are_refused(ops):
    assert not gb.supported(8, (16, 40)) and gb.supported(3, (5, 64))
    assert gb.supported(12, (16, 256)) and gb.supported(14, (5, 512)) and gb.supported(13, (3, 768))
    assert not gb.supported(12, (16, 224)) and not gb.supported(14, (16, 32)) and not gb.supported(13, (16, 288))
    assert not gb.supported(10, (16, 256)) and not gb.supported(11, (16, 256))  # Q2_K, Q3_K: no kernel
    weight, _, _ = _case("q8_0", 16, 64, seed=0)
    with pytest.raises(RuntimeError, match="64 inputs"):
        gb.linear(torch.randn(2, 32), weight)

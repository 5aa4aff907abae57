"""kernels/csrc/amx_linear_cpu.cpp: the batch-invariant bfloat16 linear on AMX. Every output
element is one fixed reduction, so a row gets the same bits alone, among any other rows, at any
thread count; and the sum is the exact fp32 dot product's to bf16 rounding."""
from __future__ import annotations

import pytest
import torch


SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (16, 32), (48, 96)]  # SmolLM2's, and small tails


@pytest.fixture(scope="module")
def ops(amx_ops):
    return amx_ops


def _case(n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.05).bfloat16())


@pytest.mark.parametrize("n, k", SHAPES)
def test_matches_the_fp32_product_to_bf16_rounding(ops, n, k):
    x, w = _case(n, k, 37, seed=n + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = ops.amx_linear(x, ops.amx_pack(w), bias)
    ref = x.float() @ w.float().T + bias.float()
    assert got.dtype == torch.bfloat16 and got.shape == (37, n)
    # one bf16 rounding of the result (2^-8 relative) and fp32 sums in another order
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=1e-3)


def test_fp32_out_keeps_the_sums_the_bf16_out_rounds(ops):
    x, w = _case(64, 576, 9, seed=4)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(2)).bfloat16()
    packed = ops.amx_pack(w)
    sums = ops.amx_linear(x, packed, bias, True)
    assert sums.dtype == torch.float32
    assert torch.equal(sums.bfloat16(), ops.amx_linear(x, packed, bias))  # one rounding of the same sums
    torch.testing.assert_close(sums, x.float() @ w.float().T + bias.float(), rtol=1e-5, atol=1e-4)  # fp32 order
    assert torch.equal(ops.amx_linear(x[3:4], packed, bias, True)[0], sums[3])


@pytest.mark.parametrize("n, k", SHAPES[:4])
def test_a_row_gets_the_same_bits_among_any_rows(ops, n, k):
    x, w = _case(n, k, 300, seed=7)
    packed = ops.amx_pack(w)
    alone = torch.cat([ops.amx_linear(x[i:i + 1], packed) for i in range(0, 300, 23)])
    g = torch.Generator().manual_seed(3)
    for rows in (1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 71, 300):
        picked = torch.randperm(300, generator=g)[:rows]
        batched = ops.amx_linear(x[picked], packed)
        for j, i in enumerate(picked.tolist()):
            if i % 23 == 0:
                assert torch.equal(batched[j], alone[i // 23]), (rows, i)


def test_the_same_bits_at_one_and_two_threads(ops):
    x, w = _case(3072, 576, 130, seed=5)
    packed = ops.amx_pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.amx_linear(x, packed)
        torch.set_num_threads(2)
        two = ops.amx_linear(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_leading_dims_and_empty_input(ops):
    x, w = _case(32, 64, 6, seed=2)
    packed = ops.amx_pack(w)
    assert torch.equal(ops.amx_linear(x.view(2, 3, 64), packed).view(6, 32), ops.amx_linear(x, packed))
    assert ops.amx_linear(x[:0], packed).shape == (0, 32)


def test_bad_shapes_are_refused(ops):
    with pytest.raises(RuntimeError, match="in % 32"):
        ops.amx_pack(torch.zeros(16, 40, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="weight"):
        ops.amx_pack(torch.zeros(16, 32))
    packed = ops.amx_pack(torch.zeros(16, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x: 32 inputs"):
        ops.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bias: 16"):
        ops.amx_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, torch.zeros(8))

"""The C++ RMSNorm / rotary / SiLU-and-mul ops (kernels/csrc/elementwise_cpu.cpp) against TorchOps,
the reference: same rounding points, so fp32 agrees to float summation order and bf16/fp16 to
a unit or two in the last place (an intermediate rounded one ulp the other way, then scaled by a
weight up to 1.5) on the few elements whose float result lies that close to a rounding boundary."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.cpu_ops import load_cpu_ops
from tandem.runtime.model.ops import CpuOps, TorchOps, create_ops

pytestmark = pytest.mark.timeout(300)  # the first call compiles the ops (~20 s), cached afterwards

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REF = TorchOps()


@pytest.fixture(scope="module")
def cpu() -> CpuOps:
    ops = load_cpu_ops()
    assert ops is not None, "the CPU ops did not build: see the warning logged by load_cpu_ops"
    return CpuOps(ops)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    info = torch.finfo(want.dtype)
    two_ulps = 2 * info.eps * want.float().abs() + info.tiny
    excess = ((got.float() - want.float()).abs() - two_ulps).max().item()
    assert excess <= 0, f"{excess} past two ulps"
    assert (got != want).float().mean().item() < 0.01  # off-by-one-ulp is rare, not the rule


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (37, 100), (300, 64)])
def test_rmsnorm_and_add_rmsnorm(cpu, dtype, rows, hidden):
    x, residual = randn(rows, hidden, dtype=dtype, seed=1), randn(rows, hidden, dtype=dtype, seed=2)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    assert_close(cpu.rmsnorm(x, weight, 1e-5), REF.rmsnorm(x, weight, 1e-5))
    got, got_sum = cpu.add_rmsnorm(x, residual, weight, 1e-6)
    want, want_sum = REF.add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(got_sum, want_sum)  # one rounded add: exact
    assert_close(got, want)


def test_rmsnorm_of_heads_view(cpu):
    """Qwen3's q/k norm: [T, H, D] views of the fused qkv output, one norm per head row."""
    qkv = randn(5, 3 * 64 + 2 * 64, dtype=torch.bfloat16, seed=4)
    q = qkv[:, :192].view(5, 3, 64)
    weight = (torch.rand(64) + 0.5).to(torch.bfloat16)
    assert_close(cpu.rmsnorm(q, weight, 1e-6), REF.rmsnorm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 19, 130])
def test_silu_and_mul(cpu, dtype, tokens):
    gate_up = randn(tokens, 2 * 200, dtype=dtype, seed=5) * 3
    assert_close(cpu.silu_and_mul(gate_up), REF.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_fused_qkv_views(cpu, dtype):
    hq, hkv, d, tokens = 9, 3, 64, 23
    qkv = randn(tokens, (hq + 2 * hkv) * d, dtype=dtype, seed=6)
    cos_sin = torch.randn(512, d, generator=torch.Generator().manual_seed(7))
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(8))
    q, k = qkv[:, :hq * d].view(tokens, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    want_q, want_k = REF.rotary(positions, q, k, cos_sin)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    got_q, got_k = cpu.rotary(positions, q, k, cos_sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v, beside them in the same rows, untouched


def test_bad_inputs_name_what_is_wrong(cpu):
    cos_sin = torch.randn(16, 8)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="past the rotary table"):
        cpu.rotary(torch.tensor([3, 16]), q, k, cos_sin)
    with pytest.raises(RuntimeError, match="weight"):
        cpu.rmsnorm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="even last dim"):
        cpu.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="not supported"):
        cpu.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))


def test_create_ops_falls_back_to_torch_without_a_build(monkeypatch):
    from tandem.kernels import cpu_ops

    assert isinstance(create_ops("cpu"), CpuOps)
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: None)
    assert isinstance(create_ops("cpu"), TorchOps)

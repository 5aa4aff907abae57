"""RMSNorm kernels vs their torch references (Triton interpreter on CPU)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.kernels.norm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref


@pytest.fixture(autouse=True)
def _default_device() -> Iterator[None]:
    """Kernels run on the GPU when there is one, else on CPU under the interpreter."""
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        yield

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rmsnorm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_add_rmsnorm_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x, r = torch.randn(2, 3, 80, dtype=dtype), torch.randn(2, 3, 80, dtype=dtype)
    x_before, r_before = x.clone(), r.clone()
    w = torch.randn(80, dtype=dtype)
    out, res = fused_add_rmsnorm(x, r, w, 1e-5)
    out_ref, res_ref = fused_add_rmsnorm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(out, out_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)
    assert torch.equal(x, x_before) and torch.equal(r, r_before)


def test_rmsnorm_on_strided_rows() -> None:
    base = torch.randn(4, 128)
    x = base[:, :64]  # rows 128 apart, unit stride inside a row
    w = torch.rand(64)
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))


def test_rmsnorm_rejects_bad_weight() -> None:
    with pytest.raises(ValueError, match="weight dim 0 must be 64"):
        rmsnorm(torch.randn(2, 64), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="same shape"):
        fused_add_rmsnorm(torch.randn(2, 64), torch.randn(3, 64), torch.ones(64), 1e-6)

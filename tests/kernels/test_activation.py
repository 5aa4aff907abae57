"""silu_and_mul kernel vs its torch reference (Triton interpreter on CPU)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.fixture(autouse=True)
def _default_device() -> Iterator[None]:
    """Kernels run on the GPU when there is one, else on CPU under the interpreter."""
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 2 * 96), (2, 3, 2 * 1500)])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1e-3 if dtype == torch.float16 else 1e-6, rtol=1e-3)


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7))

"""In-place neox rotary kernel vs its torch reference (Triton interpreter on CPU)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.kernels.rotary import apply_rotary_, rotary_ref
from tandem.runtime.model.layers import RotaryEmbedding


@pytest.fixture(autouse=True)
def _default_device() -> Iterator[None]:
    """Kernels run on the GPU when there is one, else on CPU under the interpreter."""
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 128)])
def test_rotary_matches_reference_on_fused_qkv_views(dtype: torch.dtype, heads: int, kv_heads: int,
                                                     head_dim: int) -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim, 512, 10000.0)
    tokens = 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    v_before = v.clone()
    positions = torch.tensor([0, 1, 2, 100, 300, 511])
    q_ref, k_ref = rotary_ref(positions, q, k, rope.cos_sin)
    q_out, k_out = apply_rotary_(positions, q, k, rope.cos_sin)
    assert q_out.data_ptr() == q.data_ptr()
    tol = 1e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
    assert torch.equal(v, v_before)


def test_rotary_reference_matches_model_layer() -> None:
    rope = RotaryEmbedding(32, 64, 10000.0)
    q, k, pos = torch.randn(3, 2, 32), torch.randn(3, 1, 32), torch.tensor([5, 6, 7])
    for got, want in zip(rotary_ref(pos, q, k, rope.cos_sin), rope(pos, q, k)):
        torch.testing.assert_close(got, want)


def test_rotary_rejects_mismatched_cache() -> None:
    with pytest.raises(ValueError, match="cos_sin dim 1 must be 32"):
        apply_rotary_(torch.zeros(2, dtype=torch.int64), torch.randn(2, 2, 32), torch.randn(2, 1, 32),
                      torch.randn(10, 16))

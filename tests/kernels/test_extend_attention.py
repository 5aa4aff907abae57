"""Extend (prefill over a cached prefix) attention kernel vs its torch reference (Triton interpreter)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.kernels.extend_attention import extend_attention_fwd, extend_attention_ref, extend_config


@pytest.fixture(autouse=True)
def _default_device() -> Iterator[None]:
    """Kernels run on the GPU when there is one, else on CPU under the interpreter."""
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        yield

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
HEADS = [(4, 4, 64), (8, 2, 128)]  # MHA, GQA


def _ragged_case(prefix: list[int], extend: list[int], heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pool_dtype: torch.dtype | None = None):
    slots = sum(prefix) + 8
    k_buf = torch.randn(slots, kv_heads, head_dim).to(pool_dtype or dtype)
    v_buf = torch.randn(slots, kv_heads, head_dim).to(pool_dtype or dtype)
    kv_indices = torch.randperm(slots - 1)[:sum(prefix)] + 1
    kv_indptr, qo_indptr = (torch.zeros(len(prefix) + 1, dtype=torch.int32) for _ in range(2))
    kv_indptr[1:] = torch.tensor(prefix).cumsum(0)
    qo_indptr[1:] = torch.tensor(extend).cumsum(0)
    tokens = sum(extend)
    q = torch.randn(tokens, heads, head_dim, dtype=dtype)
    kv = torch.randn(tokens, 2 * kv_heads, head_dim, dtype=dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]  # strided views, as split from a fused projection
    return q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_extend_matches_reference_on_ragged_batch(dtype: torch.dtype, heads: int, kv_heads: int,
                                                  head_dim: int) -> None:
    torch.manual_seed(0)
    # prefixes: none, short, several KV blocks; extends: one token, several q blocks
    prefix, extend = [0, 5, 70, 0], [1, 20, 9, 40]
    args = _ragged_case(prefix, extend, heads, kv_heads, head_dim, dtype)
    out = extend_attention_fwd(*args, max(extend), head_dim ** -0.5, block_m=16, block_n=16)
    ref = extend_attention_ref(*args, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("pool_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_extend_reads_an_fp8_prefix(pool_dtype: torch.dtype) -> None:
    """The cached prefix comes from an fp8 pool, widened exactly; the new tokens stay in q's dtype."""
    torch.manual_seed(3)
    prefix, extend = [0, 5, 40], [3, 20, 9]
    args = _ragged_case(prefix, extend, 8, 2, 64, torch.float32, pool_dtype)
    out = extend_attention_fwd(*args, max(extend), 0.125, block_m=16, block_n=16)
    torch.testing.assert_close(out, extend_attention_ref(*args, 0.125), atol=1e-5, rtol=1e-5)


def test_extend_with_default_tiles() -> None:
    torch.manual_seed(1)
    prefix, extend = [3, 0], [5, 2]
    args = _ragged_case(prefix, extend, 4, 2, 64, torch.float16)
    out = extend_attention_fwd(*args, max(extend), 0.125)
    torch.testing.assert_close(out, extend_attention_ref(*args, 0.125), atol=2e-3, rtol=2e-3)


def test_extend_config_scales_with_head_dim_and_dtype() -> None:
    small, large = extend_config(64, torch.float16), extend_config(256, torch.float16)
    assert small["BLOCK_M"] * small["BLOCK_N"] > large["BLOCK_M"] * large["BLOCK_N"]
    assert extend_config(128, torch.float32)["BLOCK_M"] <= extend_config(128, torch.float16)["BLOCK_M"]
    with pytest.raises(ValueError, match="head dim up to 256"):
        extend_config(512, torch.float16)


def test_extend_rejects_mismatched_tokens() -> None:
    q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices = _ragged_case([2], [3], 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="k dim 0 must be 3"):
        extend_attention_fwd(q, k[:2], v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 3, 0.1)

"""Split-KV decode attention kernel vs its torch reference (Triton interpreter on CPU)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.kernels.decode_attention import decode_attention_fwd, decode_attention_ref, num_kv_splits


@pytest.fixture(autouse=True)
def _default_device() -> Iterator[None]:
    """Kernels run on the GPU when there is one, else on CPU under the interpreter."""
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        yield

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
HEADS = [(4, 4, 64), (8, 2, 128)]  # MHA, GQA (4 q heads per kv head)


def _paged_case(lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                pool_dtype: torch.dtype | None = None):
    """Pool with a dummy slot 0 and each request's keys scattered over random slots."""
    slots = sum(lens) + 8
    k_buf = torch.randn(slots, kv_heads, head_dim).to(pool_dtype or dtype)
    v_buf = torch.randn(slots, kv_heads, head_dim).to(pool_dtype or dtype)
    kv_indices = torch.randperm(slots - 1)[:sum(lens)] + 1
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(lens).cumsum(0)
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    return q, k_buf, v_buf, kv_indptr, kv_indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEADS)
def test_decode_matches_reference_on_ragged_batch(dtype: torch.dtype, heads: int, kv_heads: int,
                                                  head_dim: int) -> None:
    torch.manual_seed(0)
    # a length-1 request, one shorter than a block, and two spanning several splits (40 with 4
    # splits of 16 leaves the last split empty)
    lens = [1, 9, 40, 150]
    q, k_buf, v_buf, kv_indptr, kv_indices = _paged_case(lens, heads, kv_heads, head_dim, dtype)
    splits = num_kv_splits(lens, kv_heads, min_split_len=10, max_splits=4)
    assert splits == [1, 1, 4, 4]
    out = decode_attention_fwd(q, k_buf, v_buf, kv_indptr, kv_indices, torch.tensor(splits, dtype=torch.int32),
                               max(splits), head_dim ** -0.5, block_n=16)
    ref = decode_attention_ref(q, k_buf, v_buf, kv_indptr, kv_indices, head_dim ** -0.5)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


# an fp8 pool (--kv-cache-dtype) is widened exactly as it is read, so the tolerance is q's dtype's
@pytest.mark.parametrize("pool_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_reads_an_fp8_pool(pool_dtype: torch.dtype, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    lens = [1, 9, 40]
    q, k_buf, v_buf, kv_indptr, kv_indices = _paged_case(lens, 8, 2, 64, dtype, pool_dtype)
    splits = torch.tensor([1, 1, 2], dtype=torch.int32)
    out = decode_attention_fwd(q, k_buf, v_buf, kv_indptr, kv_indices, splits, 2, 0.125, block_n=16)
    ref = decode_attention_ref(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_split_count_does_not_change_result() -> None:
    torch.manual_seed(1)
    lens = [33, 70]
    q, k_buf, v_buf, kv_indptr, kv_indices = _paged_case(lens, 2, 1, 64, torch.float32)
    outs = [decode_attention_fwd(q, k_buf, v_buf, kv_indptr, kv_indices, torch.full((2,), n, dtype=torch.int32),
                                 n, 0.125, block_n=16) for n in (1, 3)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_num_kv_splits_adapts_to_length_and_batch() -> None:
    assert num_kv_splits([100, 1000, 100000], 8, min_split_len=256, max_splits=16, target_programs=264) == [1, 4, 11]
    assert num_kv_splits([100000] * 64, 8, target_programs=264) == [1] * 64  # batch already fills the GPU
    assert num_kv_splits([], 8) == []


def test_decode_rejects_bad_shapes() -> None:
    q, k_buf, v_buf, kv_indptr, kv_indices = _paged_case([4], 3, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention_fwd(q, k_buf, v_buf, kv_indptr, kv_indices, torch.ones(1, dtype=torch.int32), 1, 0.1)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="must hold torch.float16 .the model's. or an fp8 dtype"):
        decode_attention_fwd(q, k_buf, v_buf, kv_indptr, kv_indices, torch.ones(1, dtype=torch.int32), 1, 0.1)

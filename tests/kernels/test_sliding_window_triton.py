"""Sliding-window attention in the Triton kernels (decode and extend) against their torch references,
under the interpreter on CPU (fp32 and fp16: the interpreter's bf16 is broken). A query at position
p sees keys p - window + 1 .. p; every key before every query's window holds NaN for the kernel,
so one read of it would make the output NaN."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.kernels.decode_attention import decode_attention_fwd, decode_attention_ref, num_kv_splits
from tandem.kernels.extend_attention import extend_attention_fwd, extend_attention_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _default_device() -> Iterator[None]:
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        yield


def _poisoned(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = buf.clone()
    out[slots] = float("nan")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 7, 20, 64])
def test_decode_reads_only_each_querys_window(dtype: torch.dtype, window: int) -> None:
    torch.manual_seed(0)
    lens = [1, 9, 20, 21, 40, 150]
    slots = sum(lens) + 8
    k_buf, v_buf = (torch.randn(slots, 2, 64).to(dtype) for _ in range(2))
    kv_indices = torch.randperm(slots - 1)[:sum(lens)] + 1
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.tensor(lens).cumsum(0)
    q = torch.randn(len(lens), 8, 64, dtype=dtype)
    ref = decode_attention_ref(q, k_buf, v_buf, kv_indptr, kv_indices, 0.125, window=window)
    bounds = kv_indptr.tolist()
    outside = torch.cat([kv_indices[s:max(s, e - window)] for s, e in zip(bounds[:-1], bounds[1:])])
    # splits by the keys inside the window, as the backend sizes them; short splits so the window spans several
    splits = num_kv_splits([min(n, window) for n in lens], 2, min_split_len=8, max_splits=4, target_programs=None)
    out = decode_attention_fwd(q, _poisoned(k_buf, outside), _poisoned(v_buf, outside), kv_indptr, kv_indices,
                               torch.tensor(splits), max(splits), 0.125, block_n=16, window=window)
    assert torch.isfinite(out).all(), "a key before its window was read"
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_window_with_per_query_lengths() -> None:
    """An extend's tokens as decode queries over one slot list (kv_lens), each with its window."""
    torch.manual_seed(1)
    n, window = 30, 6
    k_buf, v_buf = torch.randn(40, 1, 32), torch.randn(40, 1, 32)
    kv_indices = torch.randperm(39)[:n] + 1
    q = torch.randn(n, 2, 32)
    kv_lens = torch.arange(1, n + 1)
    out = decode_attention_fwd(q, k_buf, v_buf, torch.zeros(n + 1, dtype=torch.int64), kv_indices,
                               torch.ones(n, dtype=torch.int64), 1, 0.2, block_n=16, kv_lens=kv_lens, window=window)
    for t in range(n):
        one = decode_attention_ref(q[t:t + 1], k_buf, v_buf, torch.tensor([0, t + 1]), kv_indices, 0.2, window=window)
        torch.testing.assert_close(out[t:t + 1], one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 5, 17, 40])
def test_extend_reads_only_each_querys_window(dtype: torch.dtype, window: int) -> None:
    """Ragged prefixes and extends, q blocks of 16 rows and key blocks of 16: windows that start in
    the prefix, in the new tokens, mid-block and past the whole sequence."""
    torch.manual_seed(2)
    prefix, extend = [0, 5, 70, 0, 33], [1, 20, 9, 40, 35]
    slots = sum(prefix) + 8
    k_buf, v_buf = (torch.randn(slots, 2, 64).to(dtype) for _ in range(2))
    kv_indices = torch.randperm(slots - 1)[:sum(prefix)] + 1
    kv_indptr, qo_indptr = (torch.zeros(len(prefix) + 1, dtype=torch.int64) for _ in range(2))
    kv_indptr[1:] = torch.tensor(prefix).cumsum(0)
    qo_indptr[1:] = torch.tensor(extend).cumsum(0)
    tokens = sum(extend)
    q = torch.randn(tokens, 8, 64, dtype=dtype)
    k, v = torch.randn(tokens, 2, 64, dtype=dtype), torch.randn(tokens, 2, 64, dtype=dtype)
    ref = extend_attention_ref(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, 0.125, window=window)
    # before the first new token's window: no query of its request may read it
    outside = torch.cat([kv_indices[s:s + max(0, p - window + 1)] for s, p in zip(kv_indptr[:-1].tolist(), prefix)])
    out = extend_attention_fwd(q, k, v, _poisoned(k_buf, outside), _poisoned(v_buf, outside), qo_indptr,
                               kv_indptr, kv_indices, max(extend), 0.125, block_m=16, block_n=16, window=window)
    assert torch.isfinite(out).all(), "a key before every window was read"
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_extend_rows_past_the_first_block_skip_the_keys_before_their_block() -> None:
    """The second block of 16 queries (positions 16..31, window 4) must not load keys 0..11: poison
    them in the new K/V and check only that block's rows."""
    torch.manual_seed(3)
    n, window = 32, 4
    q, k, v = torch.randn(n, 2, 32), torch.randn(n, 1, 32), torch.randn(n, 1, 32)
    empty = torch.zeros(1, 1, 32)
    indptr0, qo = torch.zeros(2, dtype=torch.int64), torch.tensor([0, n])
    ref = extend_attention_ref(q, k, v, empty, empty, qo, indptr0, torch.zeros(0, dtype=torch.int64), 0.3,
                               window=window)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:16 - window + 1], v_bad[:16 - window + 1] = float("nan"), float("nan")
    out = extend_attention_fwd(q, k_bad, v_bad, empty, empty, qo, indptr0, torch.zeros(0, dtype=torch.int64), n, 0.3,
                               block_m=16, block_n=16, window=window)
    assert torch.isfinite(out[16:]).all()
    torch.testing.assert_close(out[16:], ref[16:], atol=1e-5, rtol=1e-5)

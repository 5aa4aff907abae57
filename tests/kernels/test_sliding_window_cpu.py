"""Sliding-window attention in the C++ CPU op (kernels/csrc/decode_attention_cpu.cpp and
attention_amx.h): a query at length n attends to its row's keys [n - window, n) only, matches
softmax attention over those keys, and never reads a key before its window (those slots hold NaN
here, and one read would make the output NaN). On AMX, a windowed query still gets the same bits
as a decode query, in an extend, in chunks and beside others."""
from __future__ import annotations

import math

import pytest
import torch

from tandem.kernels.cpu_ops import load_cpu_ops

pytestmark = pytest.mark.timeout(300)  # the first call may compile the ops


@pytest.fixture(scope="module")
def ops():
    built = load_cpu_ops()
    assert built is not None, "the CPU op did not build: see the warning logged by load_cpu_ops"
    return built


def _case(dtype: torch.dtype, hq: int, hkv: int, d: int, lens: list[int], window: int, seed: int = 0):
    """One request per query, each in its own row; every slot before a query's window holds NaN."""
    g = torch.Generator().manual_seed(seed)
    pool = sum(lens) + 9
    k = torch.randn(pool, hkv, d, generator=g).to(dtype)
    v = torch.randn(pool, hkv, d, generator=g).to(dtype)
    req_to_token = torch.zeros(len(lens), max(lens) + 5, dtype=torch.int64)
    slots = torch.randperm(pool - 1, generator=g) + 1
    start = 0
    for row, n in enumerate(lens):
        req_to_token[row, :n] = slots[start:start + n]
        start += n
        outside = req_to_token[row, :max(0, n - window)]
        k[outside], v[outside] = float("nan"), float("nan")
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, k, v, req_to_token, torch.arange(len(lens)), torch.tensor(lens)


def _reference(q, k, v, req_to_token, rows, lens, scale, window):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        slots = req_to_token[row, max(0, n - window):n]
        keys = k[slots].double().repeat_interleave(group, dim=1)
        values = v[slots].double().repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", w, values)
    return out


# bf16 on a CPU with AMX takes attention_amx.h at head dims 64 and 128, the AVX-512 path elsewhere;
# head dim 32 and 256 take the portable one
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("hq, hkv, d", [(4, 1, 64), (8, 2, 128), (6, 2, 32), (4, 1, 256)])
@pytest.mark.parametrize("window", [1, 16, 40])
def test_a_window_query_attends_to_its_window_only(ops, dtype, tol, hq, hkv, d, window):
    lens = [1, 15, 16, 17, 40, 41, 97, 130]
    q, k, v, r2t, rows, seq_lens = _case(dtype, hq, hkv, d, lens, window)
    scale = 1 / math.sqrt(d)
    out = ops.decode_attention(q, k, v, r2t, rows, seq_lens, scale, window=window)
    assert torch.isfinite(out).all(), "a key before its window was read"
    ref = _reference(q, k, v, r2t, rows, seq_lens, scale, window)
    assert (out.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 2e-3)])
def test_head_dim_256_without_a_window(ops, dtype, tol):
    """Gemma 3's head dim takes the AVX-512 path (where the CPU has it) with or without a window."""
    q, k, v, r2t, rows, seq_lens = _case(dtype, 4, 1, 256, [1, 30, 77], window=10 ** 6)
    out = ops.decode_attention(q, k, v, r2t, rows, seq_lens, 1 / 16)
    assert (out.double() - _reference(q, k, v, r2t, rows, seq_lens, 1 / 16, 10 ** 6)).abs().max().item() < tol


def test_a_window_past_the_length_is_every_key(ops):
    q, k, v, r2t, rows, seq_lens = _case(torch.float32, 4, 2, 64, [3, 20], window=1000)
    assert torch.equal(ops.decode_attention(q, k, v, r2t, rows, seq_lens, 0.125, window=1000),
                       ops.decode_attention(q, k, v, r2t, rows, seq_lens, 0.125))


def test_a_negative_window_is_refused(ops):
    q, k, v, r2t, rows, seq_lens = _case(torch.float32, 4, 2, 64, [3], window=3)
    with pytest.raises(RuntimeError, match="window"):
        ops.decode_attention(q, k, v, r2t, rows, seq_lens, 0.125, window=-1)


@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("window", [1, 33, 50])
def test_amx_window_bits_are_the_same_decoded_extended_chunked_and_beside_others(amx_ops, hq, hkv, d, window):
    """Token t of one request's 150-token extend (length t + 1) against the same query alone, in
    chunks over a cached prefix, and beside other requests in one call; the slots before the
    first token's window hold NaN."""
    g = torch.Generator().manual_seed(5)
    pool, tokens = 400, 150
    k = torch.randn(pool, hkv, d, generator=g).bfloat16()
    v = torch.randn(pool, hkv, d, generator=g).bfloat16()
    r2t = torch.zeros(3, pool, dtype=torch.int64)
    r2t[1, :300] = torch.randperm(pool - 1, generator=g)[:300] + 1
    r2t[2, :100] = torch.randperm(pool - 1, generator=g)[:100] + 1
    q = torch.randn(tokens, hq, d, generator=g).bfloat16()
    scale = 1 / math.sqrt(d)

    def extend(q_part: torch.Tensor, first_len: int) -> torch.Tensor:
        n = q_part.shape[0]
        lens = torch.arange(first_len, first_len + n)
        return amx_ops.decode_attention(q_part, k, v, r2t, torch.ones(n, dtype=torch.int64), lens, scale,
                                        window=window)

    whole = extend(q, 1)
    one = torch.ones(1, dtype=torch.int64)
    decoded = torch.cat([amx_ops.decode_attention(q[t:t + 1], k, v, r2t, one, one * (t + 1), scale, window=window)
                         for t in range(tokens)])
    assert torch.equal(decoded, whole)
    for size in (1, 7, 64):
        assert torch.equal(torch.cat([extend(q[s:s + size], s + 1) for s in range(0, tokens, size)]), whole), size
    other = torch.randn(20, hq, d, generator=g).bfloat16()
    rows = torch.tensor([2] + [1] * tokens + [2] * 19)
    lens = torch.cat([torch.tensor([90]), torch.arange(1, tokens + 1), torch.arange(60, 79)])
    mixed = amx_ops.decode_attention(torch.cat([other[:1], q, other[1:]]), k, v, r2t, rows, lens, scale,
                                     window=window)
    assert torch.equal(mixed[1:1 + tokens], whole)
    # the last 60 tokens alone, their prefix's slots before every window poisoned: still the same bits
    first = tokens - 60
    k[r2t[1, :max(0, first + 1 - window)]] = float("nan")
    assert torch.equal(extend(q[first:], first + 1), whole[first:])

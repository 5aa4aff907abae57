"""kernels/csrc/attention_amx.h: bfloat16 paged attention on AMX, one arithmetic for decode and
extend. A query row's output must be the same bits whether it comes as a decode query alone, as
one token of an extend (whole or in chunks of any size), beside other requests, or at another
thread count; and it must be softmax attention to bf16 rounding."""
from __future__ import annotations

import math

import pytest
import torch


# (query heads, KV heads, head dim): SmolLM2's GQA, MHA, head dim 128, and a group past 16 rows
SHAPES = [(9, 3, 64), (4, 4, 64), (8, 2, 128), (32, 1, 64)]
POOL = 700


@pytest.fixture(scope="module")
def ops(amx_ops):
    return amx_ops


def _pool(hkv: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bf16 KV pool and a req_to_token table whose rows 1 and 2 hold scattered slots."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL, hkv, d, generator=g).bfloat16()
    v = torch.randn(POOL, hkv, d, generator=g).bfloat16()
    req_to_token = torch.zeros(3, POOL, dtype=torch.int64)
    req_to_token[1, :300] = torch.randperm(POOL - 1, generator=g)[:300] + 1
    req_to_token[2, :300] = torch.randperm(POOL - 1, generator=g)[:300] + 1
    return k, v, req_to_token


def _queries(tokens: int, hq: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, hq, d, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _extend(ops, q, k, v, req_to_token, row: int, first_len: int) -> torch.Tensor:
    """q's tokens as one request's extend: token i attends over the row's first first_len + i slots."""
    tokens = q.shape[0]
    rows = torch.full((tokens,), row, dtype=torch.int64)
    lens = torch.arange(first_len, first_len + tokens, dtype=torch.int64)
    return ops.decode_attention(q, k, v, req_to_token, rows, lens, 1 / math.sqrt(q.shape[-1]))


@pytest.mark.parametrize("hq, hkv, d", SHAPES)
def test_matches_softmax_attention_to_bf16_rounding(ops, hq, hkv, d):
    k, v, req_to_token = _pool(hkv, d, seed=hq + d)
    q = _queries(70, hq, d, seed=1)
    got = _extend(ops, q, k, v, req_to_token, row=1, first_len=1)
    slots = req_to_token[1, :70]
    keys, values = k[slots].double(), v[slots].double()
    group = hq // hkv
    ref = torch.empty(70, hq, d, dtype=torch.float64)
    for t in range(70):
        for head in range(hq):
            w = torch.softmax(keys[: t + 1, head // group] @ q[t, head].double() / math.sqrt(d), 0)
            ref[t, head] = w @ values[: t + 1, head // group]
    # the weights are rounded once to bf16 (2^-9 relative each) before they meet V, and the output
    # once more (2^-8): over values of unit scale that is a few 2^-8 at most
    torch.testing.assert_close(got.double(), ref, rtol=2 ** -7, atol=2 ** -6)


@pytest.mark.parametrize("hq, hkv, d", SHAPES)
def test_a_query_gets_the_same_bits_as_decode_extend_chunks_and_beside_others(ops, hq, hkv, d):
    k, v, req_to_token = _pool(hkv, d, seed=7)
    tokens = 150
    q = _queries(tokens, hq, d, seed=2)
    whole = _extend(ops, q, k, v, req_to_token, row=1, first_len=1)
    scale = 1 / math.sqrt(d)
    one = torch.ones(1, dtype=torch.int64)
    decoded = torch.cat([ops.decode_attention(q[t: t + 1], k, v, req_to_token, one, one * (t + 1), scale)
                         for t in range(tokens)])
    assert torch.equal(decoded, whole)
    for size in (1, 7, 64):  # prefilled in chunks over a cached prefix
        chunks = [_extend(ops, q[s: s + size], k, v, req_to_token, row=1, first_len=s + 1)
                  for s in range(0, tokens, size)]
        assert torch.equal(torch.cat(chunks), whole), f"chunks of {size}"
    # beside a decode query of another request and another request's extend, in one call
    other = _queries(40, hq, d, seed=3)
    q_mixed = torch.cat([other[:1], q, other])
    rows = torch.tensor([2] + [1] * tokens + [2] * 40)
    lens = torch.cat([torch.tensor([260]), torch.arange(1, tokens + 1), torch.arange(100, 140)])
    mixed = ops.decode_attention(q_mixed, k, v, req_to_token, rows, lens, scale)
    assert torch.equal(mixed[1: 1 + tokens], whole)


def test_the_same_bits_at_one_and_two_threads(ops):
    k, v, req_to_token = _pool(3, 64, seed=11)
    q = _queries(90, 9, 64, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _extend(ops, q, k, v, req_to_token, row=2, first_len=30)
        torch.set_num_threads(2)
        pair = _extend(ops, q, k, v, req_to_token, row=2, first_len=30)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, pair)

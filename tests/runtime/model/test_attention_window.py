"""A layer's sliding window through the attention backends: torch (the reference, a masked SDPA),
cpu (the C++ op) and triton (interpreted kernels) agree on ragged decode and extend batches over
cached prefixes, and the cpu and triton backends never read a key before a query's window (those
pool slots hold NaN for them)."""
from __future__ import annotations

import pytest
import torch

from tandem.runtime.cache.pools import KVPool, ReqToTokenPool
from tandem.runtime.model.attention import create_attention_backend
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode

HEADS, KV_HEADS, HEAD_DIM, POOL = 4, 2, 16, 512
CASES = {  # mode, cached prefix lengths, new token counts
    "decode ragged": (ForwardMode.DECODE, [0, 5, 40, 1, 70], [1, 1, 1, 1, 1]),
    "extend ragged over prefixes": (ForwardMode.EXTEND, [0, 3, 0, 17, 50], [1, 9, 33, 2, 20]),
    "extend rows with nothing new": (ForwardMode.EXTEND, [4, 0, 6], [0, 3, 0]),
}


def _attend(backend: str, mode: ForwardMode, prefix: list[int], extend: list[int], window: int,
            poison: bool = False) -> torch.Tensor:
    """One layer's attention on a pool of random K/V, the prefixes at scattered slots. With
    `poison` the slots before the first new token's window of each request hold NaN."""
    gen = torch.Generator().manual_seed(0)
    kv, r2t = KVPool(POOL, 1, KV_HEADS, HEAD_DIM, torch.float32, "cpu"), ReqToTokenPool(len(prefix), 128, "cpu")
    slots = torch.randperm(POOL - 1, generator=gen) + 1
    kv.set_kv(0, torch.arange(POOL), torch.randn(POOL, KV_HEADS, HEAD_DIM, generator=gen),
              torch.randn(POOL, KV_HEADS, HEAD_DIM, generator=gen))
    start = 0
    for row, (p, e) in enumerate(zip(prefix, extend)):
        r2t.req_to_token[row, :p + e] = slots[start:start + p + e]
        start += p + e
        if poison:
            outside = r2t.req_to_token[row, :max(0, p - window + 1)]
            kv.k_buffer[0][outside], kv.v_buffer[0][outside] = float("nan"), float("nan")
    loc = torch.cat([r2t.req_to_token[row, p:p + e] for row, (p, e) in enumerate(zip(prefix, extend))])
    tokens = sum(extend)
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    batch = ForwardBatch.build(mode, list(range(tokens)), list(range(len(prefix))), prefix, extend, loc)
    attn = create_attention_backend(backend, kv, r2t)
    attn.init_forward(batch)
    return attn.forward(q, k, v, 0, batch, HEAD_DIM ** -0.5, window=window)


@pytest.mark.parametrize("window", [1, 4, 16, 1000])
@pytest.mark.parametrize("case", sorted(CASES))
def test_backends_agree_and_read_only_the_window(case: str, window: int) -> None:
    ref = _attend("torch", *CASES[case], window)
    assert torch.isfinite(ref).all()
    if window < 1000 and case != "extend rows with nothing new":  # the window narrows some query's keys
        assert not torch.allclose(ref, _attend("torch", *CASES[case], 0))
    for backend in ("cpu", "triton"):
        got = _attend(backend, *CASES[case], window, poison=True)
        assert torch.isfinite(got).all(), f"{backend} read a key before a window"
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=backend)


def test_triton_decode_sizes_a_window_layers_splits_by_the_window() -> None:
    """A window layer's decode splits come from min(length, window), made once per pass per window."""
    from tandem.runtime.model.attention_triton import TritonAttnBackend

    kv, r2t = KVPool(POOL, 1, KV_HEADS, HEAD_DIM, torch.float32, "cpu"), ReqToTokenPool(2, 600, "cpu")
    r2t.req_to_token[0, :500] = torch.arange(1, 501)
    attn = TritonAttnBackend(kv, r2t, min_split_len=64, max_kv_splits=8)
    batch = ForwardBatch.build(ForwardMode.DECODE, [1], [0], [499], [1], torch.tensor([500]))
    attn.init_forward(batch)
    meta = batch.attn_metadata
    assert meta.max_splits == 8
    splits, most = attn._splits(meta, 100)
    assert most == 2 and splits.tolist() == [2]
    assert attn._splits(meta, 100)[0] is splits

"""The attention backends on CPU (torch reference, the C++ decode op, Triton in its interpreter)
agree on random inputs: ragged batches, a length-1 sequence, a row with nothing new, fp8 pools."""
from __future__ import annotations

import pytest
import torch

from tandem.runtime.cache.pools import KVPool, ReqToTokenPool
from tandem.runtime.model.attention import create_attention_backend
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode

HEADS, KV_HEADS, HEAD_DIM, POOL = 4, 2, 16, 512
CASES = {  # mode, cached prefix lengths, new token counts
    "decode ragged": (ForwardMode.DECODE, [0, 5, 40, 1], [1, 1, 1, 1]),
    "decode length 1": (ForwardMode.DECODE, [0], [1]),
    "extend ragged over prefixes": (ForwardMode.EXTEND, [0, 3, 0, 17], [1, 9, 33, 2]),
    "extend length 1": (ForwardMode.EXTEND, [0], [1]),
    "extend rows with nothing new": (ForwardMode.EXTEND, [4, 0, 6], [0, 3, 0]),
}


def _attend(backend: str, mode: ForwardMode, prefix: list[int], extend: list[int],
            kv_dtype: torch.dtype, round_new: bool = False) -> torch.Tensor:
    """One layer's attention on a pool of random K/V, the prefixes at scattered slots; with
    `round_new` the pass's own K/V are rounded to the pool's dtype first."""
    gen = torch.Generator().manual_seed(0)
    kv, r2t = KVPool(POOL, 1, KV_HEADS, HEAD_DIM, kv_dtype, "cpu"), ReqToTokenPool(len(prefix), 128, "cpu")
    slots = torch.randperm(POOL - 1, generator=gen) + 1  # slot 0 is padding
    kv.set_kv(0, torch.arange(POOL), torch.randn(POOL, KV_HEADS, HEAD_DIM, generator=gen),
              torch.randn(POOL, KV_HEADS, HEAD_DIM, generator=gen))
    start = 0
    for row, (p, e) in enumerate(zip(prefix, extend)):
        r2t.req_to_token[row, :p + e] = slots[start:start + p + e]
        start += p + e
    loc = torch.cat([r2t.req_to_token[row, p:p + e] for row, (p, e) in enumerate(zip(prefix, extend))])
    tokens = sum(extend)
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    if round_new:
        k, v = k.to(kv_dtype).float(), v.to(kv_dtype).float()
    batch = ForwardBatch.build(mode, list(range(tokens)), list(range(len(prefix))), prefix, extend, loc)
    attn = create_attention_backend(backend, kv, r2t)
    attn.init_forward(batch)
    return attn.forward(q, k, v, 0, batch, HEAD_DIM ** -0.5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("case", sorted(CASES))
def test_backends_agree(case: str, kv_dtype: torch.dtype) -> None:
    """fp32 queries: only summation order differs. With an fp8 pool every backend reads the cached
    prefix rounded. The torch and triton backends attend over a pass's own K/V as computed; the cpu
    backend reads them back rounded too, as decode does, so a chunk boundary changes no bits."""
    ref = _attend("torch", *CASES[case], kv_dtype)
    torch.testing.assert_close(_attend("triton", *CASES[case], kv_dtype), ref, atol=1e-5, rtol=1e-5)
    cpu_ref = _attend("torch", *CASES[case], kv_dtype, round_new=True)
    torch.testing.assert_close(_attend("cpu", *CASES[case], kv_dtype), cpu_ref, atol=1e-5, rtol=1e-5)

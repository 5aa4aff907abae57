"""Triton attention backend vs the torch backend on a whole tiny model (prefill, chunked prefill
over a cached prefix, greedy decode), plus the lazy-import and argument contracts."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem.runtime.cache.pools import KVPool, ReqToTokenPool, TokenAllocator
from tandem.runtime.model.attention import TorchAttnBackend, create_attention_backend
from tandem.runtime.model.attention_triton import TritonAttnBackend
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode
from tandem.runtime.model.llama import CausalLM

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position=256, tie_word_embeddings=False, qkv_bias=False, qk_norm=False)
MAX_CTX, POOL = 64, 256
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Side:
    """One backend with its own pools; both sides get identical slots so their KV layouts match."""

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.kv = KVPool(POOL, CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, dtype, DEVICE)
        self.r2t = ReqToTokenPool(4, MAX_CTX, DEVICE)
        if name == "triton":
            # short splits so a 30-token request already decodes over several of them
            self.attn = TritonAttnBackend(self.kv, self.r2t, min_split_len=8, max_kv_splits=4)
        else:
            self.attn = TorchAttnBackend(self.kv, self.r2t)


def _run(model: CausalLM, sides: list[_Side], mode: ForwardMode, ids: list[int], rows: list[int],
         prefix: list[int], extend: list[int], loc: torch.Tensor) -> list[torch.Tensor]:
    """Set the req_to_token rows as the scheduler would, then run one pass per side."""
    outs = []
    for side in sides:
        start = 0
        for row, p, e in zip(rows, prefix, extend):
            side.r2t.req_to_token[row, p:p + e] = loc[start:start + e].to(DEVICE)
            start += e
        batch = ForwardBatch.build(mode, ids, rows, prefix, extend, loc, device=DEVICE)
        with torch.no_grad():
            outs.append(model(batch, side.attn))
    return outs


def _tiny_model(dtype: torch.dtype) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
    return model.to(DEVICE, dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiny_model_prefill_then_decode_matches_torch_backend(dtype: torch.dtype) -> None:
    model = _tiny_model(dtype)
    sides = [_Side("torch", dtype), _Side("triton", dtype)]
    alloc = TokenAllocator(POOL)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (1, 7, 30)]
    rows = [0, 1, 2]

    # chunked prefill: request 2 first gets 20 tokens, then 10 more over its cached prefix
    prefix, extend = [0, 0, 0], [1, 7, 20]
    ids = prompts[0] + prompts[1] + prompts[2][:20]
    ref, got = _run(model, sides, ForwardMode.EXTEND, ids, rows, prefix, extend, alloc.alloc(sum(extend)))
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    next_ids = ref.argmax(-1).tolist()[:2]  # requests 0 and 1 are fully prefilled
    ref, got = _run(model, sides, ForwardMode.EXTEND, prompts[2][20:], [2], [20], [10], alloc.alloc(10))
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    next_ids += ref.argmax(-1).tolist()

    lens = [len(p) for p in prompts]
    for _ in range(4):
        ref, got = _run(model, sides, ForwardMode.DECODE, next_ids, rows, lens, [1, 1, 1], alloc.alloc(3))
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
        next_ids = ref.argmax(-1).tolist()
        lens = [n + 1 for n in lens]


def test_backend_factory_and_lazy_triton_import() -> None:
    code = ("import sys, tandem.runtime.model.attention, tandem.runtime.model.llama; "
            "assert 'triton' not in sys.modules, 'torch path imported triton'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    kv, r2t = KVPool(8, 1, 1, 16, torch.float32, DEVICE), ReqToTokenPool(1, 8, DEVICE)
    assert isinstance(create_attention_backend("triton", kv, r2t), TritonAttnBackend)


def test_decode_rejects_multi_token_batch() -> None:
    side = _Side("triton", torch.float32)
    batch = ForwardBatch.build(ForwardMode.DECODE, [1, 2], [0], [3], [2], torch.tensor([1, 2]), device=DEVICE)
    with pytest.raises(ValueError, match="decode batch has 2 tokens for 1 requests"):
        side.attn.init_forward(batch)


def test_decode_gives_a_request_the_same_bits_in_any_batch() -> None:
    """Splits follow a request's own length, never the batch size: 30 keys split 4 ways alone and
    beside 140 others (the cap by the batch this replaced, 2 programs per SM, split it once there)."""
    g, pool = torch.Generator().manual_seed(0), 1024
    kv, r2t = KVPool(pool, 1, 2, 16, torch.float32, DEVICE), ReqToTokenPool(150, MAX_CTX, DEVICE)
    kv.set_kv(0, torch.arange(pool, device=DEVICE), torch.randn(pool, 2, 16, generator=g).to(DEVICE),
              torch.randn(pool, 2, 16, generator=g).to(DEVICE))
    lens = [30] + [int(n) for n in torch.randint(1, 6, (140,), generator=g)]
    slots = torch.randperm(pool - 1, generator=g)[:sum(lens)] + 1
    start = 0
    for row, n in enumerate(lens):
        r2t.req_to_token[row, :n] = slots[start:start + n].to(DEVICE)
        start += n
    q, k, v = (torch.randn(len(lens), h, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    attn = TritonAttnBackend(kv, r2t, min_split_len=8, max_kv_splits=4)

    def decode(count: int) -> torch.Tensor:
        rows = list(range(count))
        loc = torch.stack([r2t.req_to_token[row, lens[row] - 1] for row in rows])
        batch = ForwardBatch.build(ForwardMode.DECODE, rows, rows, [n - 1 for n in lens[:count]], [1] * count, loc,
                                   device=DEVICE)
        attn.init_forward(batch)
        assert batch.attn_metadata.num_splits[0].item() == 4
        return attn.forward(q[:count], k[:count], v[:count], 0, batch, 0.25)[0]

    assert torch.equal(decode(1), decode(len(lens)))


def test_deterministic_extend_gives_a_token_decodes_bits_whole_chunked_or_beside_others() -> None:
    """--enable-deterministic-inference: each new token is a decode query over its request's first
    prefix + i + 1 keys, so it gets the bits a decode step at that length gets, whether its prompt
    came whole, in chunks over a cached prefix, or beside another request."""
    g, pool, n = torch.Generator().manual_seed(1), 512, 40
    kv, r2t = KVPool(pool, 1, 2, 16, torch.float32, DEVICE), ReqToTokenPool(4, MAX_CTX, DEVICE)
    k_all, v_all = (torch.randn(pool, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    kv.set_kv(0, torch.arange(pool, device=DEVICE), k_all, v_all)
    slots = (torch.randperm(pool - 1, generator=g)[:2 * n] + 1).to(DEVICE)
    r2t.req_to_token[0, :n], r2t.req_to_token[1, :n] = slots[:n], slots[n:]
    q = torch.randn(2 * n, 4, 16, generator=g).to(DEVICE)
    attn = TritonAttnBackend(kv, r2t, min_split_len=8, max_kv_splits=4, deterministic_extend=True)

    def run(mode: ForwardMode, rows: list[int], prefix: list[int], extend: list[int]) -> torch.Tensor:
        loc = torch.cat([r2t.req_to_token[r, p:p + e] for r, p, e in zip(rows, prefix, extend)])
        qs = torch.cat([q[r * n + p: r * n + p + e] for r, p, e in zip(rows, prefix, extend)])
        batch = ForwardBatch.build(mode, [0] * len(loc), rows, prefix, extend, loc, device=DEVICE)
        attn.init_forward(batch)
        return attn.forward(qs, k_all[loc], v_all[loc], 0, batch, 0.25)

    whole = run(ForwardMode.EXTEND, [0], [0], [n])
    chunked = torch.cat([run(ForwardMode.EXTEND, [0], [0], [13]), run(ForwardMode.EXTEND, [0], [13], [n - 13])])
    decoded = torch.cat([run(ForwardMode.DECODE, [0], [t], [1]) for t in range(n)])
    beside = run(ForwardMode.EXTEND, [1, 0], [5, 0], [20, n])[20:]
    assert torch.equal(chunked, whole) and torch.equal(decoded, whole) and torch.equal(beside, whole)
    ref = torch.stack([torch.softmax(torch.einsum("hd,khd->hk", q[t], k_all[slots[:t + 1]].repeat_interleave(2, 1))
                                     * 0.25, -1).unsqueeze(-1).mul(v_all[slots[:t + 1]].repeat_interleave(2, 1)
                                                                   .transpose(0, 1)).sum(1) for t in range(n)])
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)

"""Deterministic by default: a token's K/V and logits are the same bits whether its prompt is
prefilled whole, in chunks, over a cached prefix, decoded token by token, or run beside other
requests; and the LM head gives a row the same bits among any rows. Equality, never a tolerance."""
from __future__ import annotations

import pytest
import torch

from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model import packed_linear
from tandem.runtime.model.packed_linear import fp32_head, head_logits, packs_weights
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(600)

PROMPT_LEN = 40
# "float32/onednn": the fp32 layout tandem packs off Intel (its ISA-capped checks: test_onednn_row_invariance)
DTYPES = ["float32", "float32/onednn", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not packs_weights(torch.bfloat16), reason="no native bf16 on this CPU: bf16 runs torch's reference linear"))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """Wider than the shared tiny model: at hidden 64 oneDNN's bf16 GEMMs happen to keep a row's
    bits at any row count, at 256 they do not, so this model shows what the AMX kernel fixes."""
    from tandem.launch.make_tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("invariance") / "llama", "llama", hidden=256))


@pytest.fixture(scope="module", params=DTYPES)
def runner(request, model_dir) -> ModelRunner:
    dtype, _, layout = request.param.partition("/")
    with pytest.MonkeyPatch.context() as mp:
        if layout:
            mp.setattr(packed_linear, "fp32_layout", lambda: (layout, "the test's choice"))
        return ModelRunner(ServerArgs(model_path=model_dir, max_total_tokens=16384, max_running_requests=80,
                                      dtype=dtype))


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Rows:
    """Fresh req_to_token rows for each way of running the prompt, from pools emptied for each
    test (a test frees nothing; the pools are sized for the largest)."""

    def __init__(self, runner: ModelRunner) -> None:
        runner.req_to_token_pool.clear()
        runner.allocator.clear()
        self.runner, self.loop = runner, BareLoop(runner)

    def take(self, count: int) -> list[int]:
        rows = [self.runner.req_to_token_pool.alloc() for _ in range(count)]
        assert None not in rows, "the test's pool is too small"
        return rows

    def kv(self, row: int) -> list[torch.Tensor]:
        """The row's K and V in every layer, as stored."""
        slots = self.runner.req_to_token_pool.req_to_token[row, :PROMPT_LEN]
        pool = self.runner.kv_pool
        return [buf[slots].clone() for buf in pool.k_buffer + pool.v_buffer]


def _whole(rows: _Rows, prompt: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    [row] = rows.take(1)
    return rows.loop.prefill([prompt], [row], all_logits=True), rows.kv(row)


def _chunked(rows: _Rows, prompt: list[int], chunk: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Chunk after chunk, each over the cached prefix the earlier ones left: also a radix hit's path."""
    [row] = rows.take(1)
    logits = [rows.loop.prefill([prompt[:end]], [row], [start], all_logits=True)
              for start in range(0, len(prompt), chunk) for end in [min(start + chunk, len(prompt))]]
    return torch.cat(logits), rows.kv(row)


def _decoded(rows: _Rows, prompt: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    [row] = rows.take(1)
    logits = [rows.loop.prefill([prompt[:1]], [row], all_logits=True)]
    for pos in range(1, len(prompt)):
        logits.append(rows.loop.decode(torch.tensor([prompt[pos]]), [row], [pos], [len(prompt) - 1]))
    return torch.cat(logits), rows.kv(row)


def _batched(rows: _Rows, prompt: list[int], others: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prompt in the middle of a prefill batch of other prompts of random lengths."""
    g = torch.Generator().manual_seed(others)
    prompts = [_prompt(100 + i, int(torch.randint(1, 60, (1,), generator=g))) for i in range(others)]
    at = others // 2
    prompts.insert(at, prompt)
    batch_rows = rows.take(len(prompts))
    logits = rows.loop.prefill(prompts, batch_rows, all_logits=True)
    start = sum(len(p) for p in prompts[:at])
    return logits[start:start + PROMPT_LEN], rows.kv(batch_rows[at])


def _decoded_in_a_batch(rows: _Rows, prompt: list[int], others: int) -> torch.Tensor:
    """The prompt's last token decoded beside `others` requests decoding at other positions."""
    prompts = [_prompt(200 + i, 5 + 3 * i) for i in range(others)]
    at = others // 2
    prompts.insert(at, prompt[:-1])
    batch_rows = rows.take(len(prompts))
    rows.loop.prefill(prompts, batch_rows)
    last_ids = torch.tensor([p[-1] if i != at else prompt[-1] for i, p in enumerate(prompts)])
    seq_lens = [len(p) for p in prompts]
    return rows.loop.decode(last_ids, batch_rows, seq_lens, seq_lens)[at]


@pytest.mark.parametrize("way", ["chunks of 1", "chunks of 7", "chunks of 64", "decode token by token",
                                 "beside 1 other", "beside 5 others", "beside 31 others"])
def test_a_prompt_gets_the_same_kv_and_logits_every_way(runner, way):
    rows, prompt = _Rows(runner), _prompt(0)
    whole_logits, whole_kv = _whole(rows, prompt)
    kind, _, n = way.rpartition(" ")
    if way.startswith("chunks"):
        logits, kv = _chunked(rows, prompt, int(n))
    elif way.startswith("decode"):
        logits, kv = _decoded(rows, prompt)
    else:
        logits, kv = _batched(rows, prompt, int(way.split()[1]))
    assert logits.dtype == torch.float32
    assert torch.equal(logits, whole_logits)
    assert all(torch.equal(a, b) for a, b in zip(kv, whole_kv))


@pytest.mark.parametrize("others", [1, 6, 33, 63])
def test_a_decode_step_gets_the_same_logits_in_any_batch(runner, others):
    rows, prompt = _Rows(runner), _prompt(1)
    whole_logits, _ = _whole(rows, prompt)
    assert torch.equal(_decoded_in_a_batch(rows, prompt, others), whole_logits[-1])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lm_head_gives_a_row_the_same_fp32_bits_among_any_rows(threads, dtype):
    g = torch.Generator().manual_seed(0)
    head = fp32_head((torch.randn(4096, 192, generator=g) * 0.05).to(dtype))
    x = torch.randn(300, 192, generator=g).to(dtype)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        alone = [head_logits(x[i:i + 1], head) for i in range(0, 300, 37)]
        assert alone[0].dtype == torch.float32
        for rows in (2, 16, 33, 64, 71, 300):
            batched = head_logits(x[:rows], head)
            for i in range(0, rows, 37):
                assert torch.equal(batched[i:i + 1], alone[i // 37]), (rows, i)
    finally:
        torch.set_num_threads(saved)

"""A tiny random GPT-NeoX (no class of tandem's own) served end to end with --model-impl
transformers, under chunked prefill (16 tokens) and a forced retraction every few decode steps:
greedy equals transformers' generate batched and concurrent, a radix hit answers alike, n=2
siblings, logprobs match transformers' log_softmax, a regex-guided request, and no KV leaked."""
from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from server_utils import ServerHandle, assert_no_leaks, start_server
from tiny_transformers_models import build_tiny_transformers_model

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 12
# fp32, the same weights: tandem's attention and head sum in other orders than transformers'
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, ServerHandle]]:
    root = tmp_path_factory.mktemp("serve_gpt_neox")
    path = str(build_tiny_transformers_model(root / "model", "gpt_neox"))
    args = ["--model-path", path, "--model-impl", "transformers", "--max-total-tokens", "4000",
            "--chunked-prefill-size", "16"]
    handle = start_server(args, str(root / "server.log"),
                          env={"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1"})
    try:
        yield path, handle
    finally:
        handle.stop()


@pytest.fixture(scope="module")
def hf(served):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(served[0], dtype=torch.float32).eval()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(100, 4000, n).tolist() for n in (5, 23, 40, 61)]


def _greedy(ids, n: int = 1, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                                                  "n": n}, **extra}


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    return gen[0, len(ids):].tolist()


def test_greedy_batched_and_concurrent_equals_transformers(served, hf):
    _, server = served
    prompts = _prompts()
    want = [_hf_greedy(hf, ids) for ids in prompts]
    batch = server.generate(_greedy(prompts))
    assert [b["output_ids"] for b in batch] == want
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(lambda ids: server.generate(_greedy(ids)), prompts))
    assert [c["output_ids"] for c in concurrent] == want
    assert_no_leaks(server)


def test_radix_hit_siblings_and_logprobs(served, hf):
    _, server = served
    prompt = _prompts()[3]
    cold = server.generate(_greedy(prompt, return_logprob=True))
    hit = server.generate(_greedy(prompt + [7, 8, 9]))
    assert hit["meta_info"]["cached_tokens"] >= len(prompt) - 1
    again = server.generate(_greedy(prompt, return_logprob=True))
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == cold["output_ids"]
    logprobs = cold["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == cold["output_ids"]
    # each output token's logprob, as transformers' log_softmax over the prompt and the output before it
    ids = prompt + cold["output_ids"]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want_lp = [want[len(prompt) - 1 + i, t].item() for i, t in enumerate(cold["output_ids"])]
    np.testing.assert_allclose([lp for lp, _, _ in logprobs], want_lp, atol=LOGPROB_ATOL)
    assert [lp for lp, _, _ in again["meta_info"]["output_token_logprobs"]] == [lp for lp, _, _ in logprobs]
    siblings = server.generate(_greedy(prompt, n=2))
    assert [s["output_ids"] for s in siblings] == [cold["output_ids"]] * 2
    assert_no_leaks(server)


def test_regex_guided_decoding(served):
    _, server = served
    out = server.generate({"text": "Code:", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                "regex": "[a-z]{3,6}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", out["text"]), out["text"]
    assert_no_leaks(server)

"""Gemma 3, Qwen3-MoE and Mixtral served end to end on their tiny random models, under chunked
prefill (16 tokens: Gemma's window layers read keys of earlier chunks) and a forced retraction
every few decode steps: greedy equals transformers' generate, a radix cache hit answers alike,
n=2 siblings, logprobs (one per output token), a regex-guided request, and no KV leaked."""
from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from server_utils import ServerHandle, assert_no_leaks, start_server

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 12


@pytest.fixture(scope="module", params=["gemma3", "qwen3_moe", "mixtral"])
def served(request, tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, ServerHandle]]:
    path = tiny_model_dir(request.param)
    log = tmp_path_factory.mktemp(f"serve_{request.param}") / "server.log"
    args = ["--model-path", path, "--max-total-tokens", "4000", "--chunked-prefill-size", "16"]
    handle = start_server(args, str(log), env={"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1"})
    try:
        yield path, handle
    finally:
        handle.stop()


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(100, 4000, n).tolist() for n in (5, 23, 40, 61)]


def _greedy(ids, n: int = 1, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                                                  "n": n}, **extra}


def _transformers_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
            out.append(gen[0, len(ids):].tolist())
    return out


def test_greedy_batched_and_concurrent_equals_transformers(served):
    path, server = served
    prompts = _prompts()
    want = _transformers_greedy(path, prompts)
    batch = server.generate(_greedy(prompts))
    assert [b["output_ids"] for b in batch] == want
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(lambda ids: server.generate(_greedy(ids)), prompts))
    assert [c["output_ids"] for c in concurrent] == want
    assert_no_leaks(server)


def test_radix_hit_siblings_and_logprobs(served):
    _, server = served
    prompt = _prompts()[3]
    cold = server.generate(_greedy(prompt, return_logprob=True))
    hit = server.generate(_greedy(prompt + [7, 8, 9]))
    assert hit["meta_info"]["cached_tokens"] >= len(prompt) - 1
    again = server.generate(_greedy(prompt, return_logprob=True))
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == cold["output_ids"]
    logprobs = cold["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in logprobs] == cold["output_ids"] and all(lp <= 0 for lp, _, _ in logprobs)
    np.testing.assert_allclose([lp for lp, _, _ in again["meta_info"]["output_token_logprobs"]],
                               [lp for lp, _, _ in logprobs], atol=1e-5)
    siblings = server.generate(_greedy(prompt, n=2))
    assert [s["output_ids"] for s in siblings] == [cold["output_ids"]] * 2
    assert_no_leaks(server)


def test_regex_guided_decoding(served):
    _, server = served
    out = server.generate({"text": "Code:", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                "regex": "[a-z]{3,6}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", out["text"]), out["text"]
    assert_no_leaks(server)

"""Gemma 3, Qwen3-MoE and Mixtral served end to end on their tiny random models, under chunked
prefill (16 tokens: Gemma's window layers read keys of earlier chunks) and a forced retraction
every few decode steps: greedy equals transformers' generate, a radix cache hit answers alike,
n=2 siblings, logprobs (one per output token), a regex-guided request, and no KV leaked."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from arch_serving_checks import (MAX_NEW, assert_batched_and_concurrent, assert_regex_guided, prompts,
                                 radix_hit_and_siblings)
from server_utils import ServerHandle, start_server

pytestmark = pytest.mark.timeout(600)



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
    assert_batched_and_concurrent(server, _transformers_greedy(path, prompts()))


def test_radix_hit_siblings_and_logprobs(served):
    _, cold, again = radix_hit_and_siblings(served[1])
    logprobs = cold["meta_info"]["output_token_logprobs"]
    assert all(lp <= 0 for lp, _, _ in logprobs)
    np.testing.assert_allclose([lp for lp, _, _ in again["meta_info"]["output_token_logprobs"]],
                               [lp for lp, _, _ in logprobs], atol=1e-5)


def test_regex_guided_decoding(served):
    assert_regex_guided(served[1])

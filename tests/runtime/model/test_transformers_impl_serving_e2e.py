"""A tiny random GPT-NeoX (no class of tandem's own) served end to end with --model-impl
transformers, under chunked prefill (16 tokens) and a forced retraction every few decode steps:
greedy equals transformers' generate batched and concurrent, a radix hit answers alike, n=2
siblings, logprobs match transformers' log_softmax, a regex-guided request, and no KV leaked."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from arch_serving_checks import (MAX_NEW, assert_batched_and_concurrent, assert_regex_guided, prompts,
                                 radix_hit_and_siblings)
from server_utils import ServerHandle, start_server
from tiny_transformers_models import build_tiny_transformers_model

pytestmark = pytest.mark.timeout(600)

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


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    return gen[0, len(ids):].tolist()


def test_greedy_batched_and_concurrent_equals_transformers(served, hf):
    assert_batched_and_concurrent(served[1], [_hf_greedy(hf, ids) for ids in prompts()])


def test_radix_hit_siblings_and_logprobs(served, hf):
    prompt, cold, again = radix_hit_and_siblings(served[1])
    logprobs = cold["meta_info"]["output_token_logprobs"]
    # each output token's logprob, as transformers' log_softmax over the prompt and the output before it
    ids = prompt + cold["output_ids"]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want_lp = [want[len(prompt) - 1 + i, t].item() for i, t in enumerate(cold["output_ids"])]
    np.testing.assert_allclose([lp for lp, _, _ in logprobs], want_lp, atol=LOGPROB_ATOL)
    assert [lp for lp, _, _ in again["meta_info"]["output_token_logprobs"]] == [lp for lp, _, _ in logprobs]


def test_regex_guided_decoding(served):
    assert_regex_guided(served[1])

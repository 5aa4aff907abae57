"""Deterministic by default, from outside, on the default dtype (bf16 where the CPU has native bf16):
16 prompts give the same output ids and the same logprobs (==, no tolerance) alone, again over
their cached prefix, inside a batch of 32 others, chunked with forced retraction and overlap off or
on, and with NGRAM speculation; greedy and seeded sampling alike."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.timeout(900)
MAX_NEW = 24
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "top_p": 0.9}


def _body(i: int, sampling: dict, rid: str) -> dict:
    return {"input_ids": [(13 * i + 7 * j) % 991 + 3 for j in range(32)], "rid": rid, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "sampling_seed": 1000 + i, **sampling}}


def _bodies(sampling: dict, tag: str) -> list[dict]:
    return [_body(i, sampling, f"det-{tag}-{i}") for i in range(16)]


def _answer(out: dict) -> tuple:
    """What must be equal: ids, and every logprob and top logprob, prompt's and output's."""
    meta = out["meta_info"]
    return (out["output_ids"], meta["output_token_logprobs"], meta["output_top_logprobs"],
            meta["input_token_logprobs"], meta["input_top_logprobs"])


def _alone(server, bodies: list[dict]) -> list[tuple]:
    return [_answer(server.generate(b)) for b in bodies]


def _among_others(server, bodies: list[dict], sampling: dict) -> list[tuple]:
    others = [_body(100 + i, sampling, f"det-other-{i}") | {"input_ids": list(range(3 + i, 40 + 3 * i))}
              for i in range(32)]
    mixed = others[:16] + bodies + others[16:]
    with ThreadPoolExecutor(len(mixed)) as pool:
        outs = list(pool.map(server.generate, mixed))
    return [_answer(out) for out in outs[16:32]]


@pytest.fixture(scope="module", params=["greedy", "seeded"])
def case(request, servers):
    """The reference: each prompt alone on a server with an empty cache."""
    sampling = GREEDY if request.param == "greedy" else SEEDED
    server = servers("tiny")
    assert server.post("/flush_cache").status_code == 200
    return sampling, _alone(server, _bodies(sampling, "ref"))


def test_the_same_answer_over_a_cached_prefix(servers, case):
    sampling, reference = case
    server = servers("tiny")
    cached_before = server.info().get("num_cached_tokens")
    assert _alone(server, _bodies(sampling, "cached")) == reference
    if cached_before is not None:
        assert server.info()["num_cached_tokens"] > cached_before


def test_the_same_answer_inside_a_batch(servers, case):
    sampling, reference = case
    assert _among_others(servers("tiny"), _bodies(sampling, "batched"), sampling) == reference


@pytest.mark.parametrize("name", ["tiny_sequential_chunked_retract", "tiny_overlap_chunked_retract", "tiny_ngram"])
def test_the_same_answer_chunked_retracted_or_speculative(servers, case, name):
    sampling, reference = case
    server = servers(name)
    assert _alone(server, _bodies(sampling, name)) == reference
    assert _among_others(server, _bodies(sampling, name + "-batched"), sampling) == reference

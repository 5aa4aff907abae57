"""The serving checks every new architecture passes on its tiny model (tests/runtime/model/
test_*_serving_e2e.py): the same prompts, greedy batched and concurrent against the reference ids,
a radix hit and n=2 siblings answering alike, a regex-guided request; no KV leaked after each."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from server_utils import ServerHandle, assert_no_leaks

MAX_NEW = 12


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(100, 4000, n).tolist() for n in (5, 23, 40, 61)]


def greedy(ids, n: int = 1, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                                                  "n": n}, **extra}


def assert_batched_and_concurrent(server: ServerHandle, want: list[list[int]]) -> None:
    batch = server.generate(greedy(prompts()))
    assert [b["output_ids"] for b in batch] == want
    with ThreadPoolExecutor(len(want)) as pool:
        concurrent = list(pool.map(lambda ids: server.generate(greedy(ids)), prompts()))
    assert [c["output_ids"] for c in concurrent] == want
    assert_no_leaks(server)


def radix_hit_and_siblings(server: ServerHandle) -> tuple[list[int], dict, dict]:
    """(prompt, its cold answer with logprobs, the same after a radix hit), the hit's ids and two
    siblings' ids checked equal to the cold answer's."""
    prompt = prompts()[3]
    cold = server.generate(greedy(prompt, return_logprob=True))
    hit = server.generate(greedy(prompt + [7, 8, 9]))
    assert hit["meta_info"]["cached_tokens"] >= len(prompt) - 1
    again = server.generate(greedy(prompt, return_logprob=True))
    assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == cold["output_ids"]
    assert [t for _, t, _ in cold["meta_info"]["output_token_logprobs"]] == cold["output_ids"]
    siblings = server.generate(greedy(prompt, n=2))
    assert [s["output_ids"] for s in siblings] == [cold["output_ids"]] * 2
    assert_no_leaks(server)
    return prompt, cold, again


def assert_regex_guided(server: ServerHandle) -> None:
    out = server.generate({"text": "Code:", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                "regex": "[a-z]{3,6}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", out["text"]), out["text"]
    assert_no_leaks(server)

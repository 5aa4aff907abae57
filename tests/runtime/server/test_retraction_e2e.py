"""Retraction as hard as SGLang tests it: 8 running slots, 32 concurrent non-streaming requests of
256 greedy tokens with logprobs, a retraction forced every 3 decode steps, and non-streaming
outputs flushed every 3 tokens (TANDEM_FORCE_STREAM_INTERVAL): tokens and logprobs stay aligned
and equal a run without any retraction."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 256


def _bodies() -> list[dict]:
    return [{"input_ids": [(7 * i + j) % 997 + 3 for j in range(8 + i % 24)], "rid": f"rt-{i}",
             "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0 if i % 2 else -1,
             "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
            for i in range(32)]


def _check_aligned(out: dict, body: dict) -> None:
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == MAX_NEW
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(meta["output_top_logprobs"]) == MAX_NEW
    if body["logprob_start_len"] == 0:
        assert [t[1] for t in meta["input_token_logprobs"]] == body["input_ids"]
        assert meta["input_token_logprobs"][0][0] is None


def _values(out: dict, key: str) -> np.ndarray:
    return np.array([np.nan if t[0] is None else t[0] for t in out["meta_info"][key]], np.float64)


def test_forced_retraction_under_load_keeps_tokens_and_logprobs_exact(servers):
    reference_server, server = servers("tiny"), servers("tiny_retract_8")
    bodies = _bodies()
    retractions_before = reference_server.info()["num_retractions"]
    with ThreadPoolExecutor(8) as pool:  # 8 at a time fit the reference server: it never retracts
        reference = list(pool.map(reference_server.generate, bodies))
    assert reference_server.info()["num_retractions"] == retractions_before
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(server.generate, bodies))
    assert server.info()["num_retractions"] >= 50
    for body, out, ref in zip(bodies, outs, reference):
        _check_aligned(out, body)
        assert out["output_ids"] == ref["output_ids"], body["rid"]
        for key in ("output_token_logprobs", "input_token_logprobs") if body["logprob_start_len"] == 0 else (
                "output_token_logprobs",):
            np.testing.assert_allclose(_values(out, key), _values(ref, key), atol=1e-4, err_msg=body["rid"])
    assert_no_leaks(server)

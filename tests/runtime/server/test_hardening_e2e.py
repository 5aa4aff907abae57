"""One request can neither crash the server nor stall everyone else: values checked as the device
will see them, deep nesting, huge texts, huge batches and huge logprob asks are all a 400."""
from __future__ import annotations

import re
import threading
import time

import pytest
import requests

pytestmark = pytest.mark.timeout(300)


DEEP = "[" * 1000 + "1" + "]" * 1000  # JSON text: client libraries cannot encode this much nesting


@pytest.mark.parametrize("sp, field", [
    ({"logit_bias": {"5": 3.41e38}}, "logit_bias"),  # finite as float64, inf as float32
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 as float32
    ({"temperature": 1e39}, "temperature"),
])
def test_values_that_break_float32_are_a_400_and_the_server_lives(tiny_server, sp, field):
    resp = tiny_server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, **sp}})
    assert resp.status_code == 400 and field in resp.json()["error"]["message"], resp.text
    assert tiny_server.generate({"text": "hi", "sampling_params": {"max_new_tokens": 1}})["output_ids"]


@pytest.mark.parametrize("body, field", ids=range(6), argvalues=[
    ('{"text": "hi", "sampling_params": {"logit_bias": {"5": %s}}}' % DEEP, "logit_bias"),
    ('{"text": "hi", "sampling_params": {"seed": %s}}' % DEEP, "seed"),
    ('{"text": "hi", "return_logprob": true, "token_ids_logprob": %s}' % DEEP, "token_ids_logprob"),
    ('{"text": ["a", "b"], "rid": ["x", %s]}' % DEEP, "rid[1]"),
    ('{"text": "hi", "sampling_params": {"json_schema": {"a": %s}}}' % DEEP[700:-700], "json_schema"),
    ('{"text": "hi", "sampling_params": {"stop": %s}}' % ("[" * 1020 + "]" * 1020), "stop"),
])
def test_deeply_nested_json_is_a_400(tiny_server, body, field):
    resp = requests.post(tiny_server.url + "/generate", data=body.encode(), timeout=60)
    assert resp.status_code == 400 and field in resp.json()["error"]["message"], resp.text[:300]


def test_a_body_nested_past_the_parser_limit_is_a_400_not_a_crash(tiny_server):
    # orjson 3.8 recursed without a bound: 100,000 nested objects killed the server with SIGSEGV
    # (pyproject pins orjson>=3.10, which refuses past 1024 levels)
    body = '{"text": "hi", "x": ' + '{"a":' * 100_000 + "1" + "}" * 100_000 + "}"
    resp = requests.post(tiny_server.url + "/generate", data=body.encode(), timeout=60)
    assert resp.status_code == 400, resp.text[:300]
    assert re.search("body is not valid JSON: .*depth.* exceeded", resp.json()["error"]["message"])
    assert tiny_server.generate({"text": "hi", "sampling_params": {"max_new_tokens": 1}})["output_ids"]


def test_a_huge_text_is_refused_without_freezing_the_server(tiny_server):
    big = {"text": "hello world " * (50 * 1024 * 1024 // 12)}  # ~50 MB: passes --max-request-bytes
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("resp", requests.post(
        tiny_server.url + "/generate", json=big, timeout=120)))
    thread.start()
    health_ok = 0
    while thread.is_alive():
        health_ok += tiny_server.get("/health", timeout=5).status_code == 200
        time.sleep(0.05)
    resp = result["resp"]
    assert resp.status_code == 400 and "characters; no text longer than" in resp.json()["error"]["message"]
    assert health_ok > 0  # the event loop answered while the body was being handled


def test_batch_times_n_is_bounded(tiny_server):
    resp = tiny_server.post("/generate", {"text": ["a"] * 2000, "sampling_params": {"n": 64, "max_new_tokens": 1}})
    assert resp.status_code == 400
    assert "2000 prompt(s) x n = 128000 sequences, more than --max-batch-items (4096)" in resp.json()["error"]["message"]
    assert tiny_server.info()["num_queue_reqs"] == 0


def test_top_logprobs_num_is_capped(tiny_server):
    resp = tiny_server.post("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 0,
                                          "top_logprobs_num": 49152})
    assert resp.status_code == 400 and "--max-top-logprobs-num" in resp.json()["error"]["message"]


def test_a_full_vocabulary_logit_bias_works(tiny_server):
    bias = {str(i): -1.0 for i in range(49152)}
    bias["1234"] = 100.0
    out = tiny_server.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, "logit_bias": bias}})
    assert out["output_ids"] == [1234] * 4

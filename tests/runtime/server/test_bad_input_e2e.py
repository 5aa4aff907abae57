"""Bad input gets a 400 naming the field, never reaches the scheduler, and never hurts the server."""
from __future__ import annotations

import json
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(300)

CASES = [
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}}, "min_new_tokens"),
    ({"text": "hi", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
    ({"text": "hi", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"text": "hi", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ({"text": "hi", "sampling_params": {"stop": ["x"] * 33}}, "stop"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "n"),
    ({"text": ""}, "text"),
    ({"text": "hi", "input_ids": [1, 2]}, "input_ids"),
    ({"input_ids": [1, 99_999_999]}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10_000_000}}, "max_new_tokens"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
    ({"text": "hi", "priority": 2**70}, "priority"),
    ({"text": "hi", "stream": "yes"}, "stream"),
    ({"text": "hi", "unknown_field": 1}, "unknown_field"),
    ([1, 2, 3], "body"),
    ({"text": "hi", "sampling_params": {"json_schema": '{"type": "object"}', "regex": "a"}}, "sampling_params.regex"),
    ({"text": "hi", "sampling_params": {"choice": []}}, "sampling_params.choice"),
    ({"text": "hi", "lora_path": "my-adapter"}, "lora_path"),
]


@pytest.mark.parametrize("body,field", CASES)
def test_bad_request_is_400_naming_the_field(tiny_server, body, field):
    resp = tiny_server.post("/generate", body)
    assert resp.status_code == 400, resp.text
    assert field in resp.json()["error"]["message"]


def test_malformed_json_and_oversized_body(tiny_server):
    resp = requests.post(tiny_server.url + "/generate", data=b"{not json", timeout=30)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    big = b'{"text": "' + b"a" * (64 * 1024 * 1024 + 10) + b'"}'
    resp = requests.post(tiny_server.url + "/generate", data=big, timeout=60)
    assert resp.status_code == 400 and "max-request-bytes" in resp.json()["error"]["message"]


def test_reused_rid_of_a_running_request_is_400(tiny_server):
    import threading

    body = {"input_ids": [5] * 4, "rid": "dup-rid", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    t = threading.Thread(target=tiny_server.post, args=("/generate", body))
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not tiny_server.info()["num_running_reqs"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tiny_server.info()["num_running_reqs"], "the first request never ran"
        resp = tiny_server.post("/generate", body)
        assert resp.status_code == 400 and "rid" in resp.json()["error"]["message"]
    finally:
        tiny_server.post("/abort_request", {"rid": "dup-rid"})
        t.join(30)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
fields = st.sampled_from(["text", "input_ids", "sampling_params", "rid", "stream", "return_logprob", "logprob_start_len",
                          "top_logprobs_num", "priority", "max_new_tokens", "temperature", "n"])
bodies = st.dictionaries(fields, json_values, max_size=5) | json_values


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_fuzzed_json_never_gets_a_5xx(tiny_server, body):
    if isinstance(body, dict) and isinstance(body.get("sampling_params"), dict):
        body["sampling_params"]["max_new_tokens"] = 2  # keep the valid ones short
    # stdlib json: it writes ints beyond 64 bits (and Infinity) that other encoders refuse
    resp = requests.post(tiny_server.url + "/generate", data=json.dumps(body), timeout=60)
    assert resp.status_code < 500, resp.text
    assert requests.get(tiny_server.url + "/health", timeout=10).status_code == 200

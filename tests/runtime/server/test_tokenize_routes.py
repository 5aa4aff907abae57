"""SGLang's text utility routes on a running server (/tokenize, /detokenize and their /v1/ forms,
/separate_reasoning): SGLang's bodies, a 400 naming the field (OpenAI's error shape on /v1/)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_text_goes_to_ids_and_back(tiny_server, prefix):
    got = tiny_server.post(f"{prefix}/tokenize", json={"prompt": ["Hello world", "Hi"]})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["count"] == [len(ids) for ids in body["tokens"]] and body["max_model_len"] > 0
    back = tiny_server.post(f"{prefix}/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"text": ["Hello world", "Hi"]}


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "a", "bogus": 1}),
                                        ("/v1/detokenize", {"tokens": [1], "bogus": 1})])
def test_a_bad_field_is_a_400_that_names_it(tiny_server, path, body):
    got = tiny_server.post(path, json=body)
    assert got.status_code == 400 and "bogus" in got.text


def test_separate_reasoning_route(tiny_server):
    got = tiny_server.post("/separate_reasoning", json={"text": "<think>hm</think>Yes", "reasoning_parser": "qwen3"})
    assert got.status_code == 200 and got.json() == {"text": "Yes", "reasoning_text": "hm"}
    bad = tiny_server.post("/separate_reasoning", json={"text": "x", "reasoning_parser": "nope"})
    assert bad.status_code == 400 and "reasoning_parser" in bad.text

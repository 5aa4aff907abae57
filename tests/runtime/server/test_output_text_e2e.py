"""End-to-end: a /generate answer's text is what its output_ids decode to, streamed or not."""
from __future__ import annotations

import orjson
import pytest
import requests

pytestmark = pytest.mark.timeout(120)

EMOJI_FIRST_BYTE = 187  # "ð" in the byte-level alphabet: 0xF0, an emoji's first byte
EMOJI_FIRST_TWO = 10813  # "ðŁ": 0xF0 0x9F


def _streamed(server, body: dict) -> list[dict]:
    resp = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60)
    assert resp.status_code == 200, resp.text
    return [orjson.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: {")]


@pytest.mark.parametrize("last", [EMOJI_FIRST_BYTE, EMOJI_FIRST_TWO])
@pytest.mark.parametrize("skip", [True, False])
def test_a_prompt_ending_inside_a_character_leaves_no_replacement_char_in_front(servers, smol_tokenizer, last: int,
                                                                              skip: bool) -> None:
    """input_ids may end inside a character; the output did not complete it (the tiny model's
    first token starts a word), so the text is decode(output_ids), streamed or not: the prompt's
    unfinished character once showed as a U+FFFD in front."""
    server = servers("tiny")
    body = {"input_ids": [40, 1234, last],
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "skip_special_tokens": skip}}
    out = server.generate(body)
    assert out["text"] == smol_tokenizer.decode(out["output_ids"], skip_special_tokens=skip)
    assert not out["text"].startswith("\ufffd")
    chunks = _streamed(server, body)
    assert chunks[-1]["text"] == out["text"] and chunks[-1]["output_ids"] == out["output_ids"]
    assert all(out["text"].startswith(c["text"]) for c in chunks)

"""--log-requests (SGLang's): a line per finished request at --log-requests-level, the output text
only from level 2 (cut at 2048 characters there), and none without the flag."""
from __future__ import annotations

import json

import pytest

from server_utils import start_server

pytestmark = pytest.mark.timeout(300)


def _finish_lines(log_path: str) -> list[dict]:
    with open(log_path) as f:
        return [json.loads(line.split("Finish: ", 1)[1]) for line in f if "Finish: " in line]


@pytest.mark.parametrize("flags, text_logged", [(["--log-requests", "--log-requests-level", "3"], True),
                                                (["--log-requests", "--log-requests-level", "0"], False),
                                                ([], None)])
def test_finished_requests_are_logged_at_the_level(tmp_path, tiny_model_dir, flags, text_logged):
    log = str(tmp_path / "server.log")
    server = start_server(["--model-path", tiny_model_dir("llama"), "--log-level", "info", *flags], log)
    try:
        out = server.generate({"input_ids": [5, 6, 7], "rid": "logged-rid",
                               "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    finally:
        server.stop()
    lines = _finish_lines(log)
    if text_logged is None:
        assert lines == []
        return
    (line,) = [line for line in lines if line["rid"] == "logged-rid"]
    assert line["completion_tokens"] == 4 and line["prompt_tokens"] == 3 and line["finish_reason"]["type"] == "length"
    assert ("text" in line) is text_logged
    if text_logged:
        assert line["text"] == out["text"] and line["output_ids"] == out["output_ids"]

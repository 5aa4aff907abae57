"""--sampling-defaults model (SGLang's default): OpenAI chat requests take the model's
generation_config.json sampling for the fields they leave out; /generate keeps the API's defaults."""
from __future__ import annotations

import json
import shutil

import pytest

from server_utils import start_server

pytestmark = pytest.mark.timeout(180)
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def greedy_by_default_server(tmp_path_factory, tiny_model_dir):
    """The tiny model with a generation_config.json that recommends top_k 1: greedy unless asked otherwise."""
    folder = tmp_path_factory.mktemp("top_k_1") / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "top_k": 1}))
    server = start_server(["--model-path", str(folder), "--max-total-tokens", "2000"],
                          str(folder.parent / "server.log"))
    yield server
    server.stop()


def _chat(server, **fields) -> list[int]:
    resp = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "logprobs": True, **fields})
    assert resp.status_code == 200, resp.text
    return [entry["token"] for entry in resp.json()["choices"][0]["logprobs"]["content"]]


def test_chat_uses_the_models_top_k_where_the_request_gives_none(greedy_by_default_server):
    greedy = _chat(greedy_by_default_server, temperature=0)
    # temperature 1 with the model's top_k 1 is greedy, whatever the seed
    assert _chat(greedy_by_default_server, seed=1) == greedy == _chat(greedy_by_default_server, seed=2)
    # a request's own top_k wins: on a random tiny model, full-vocabulary samples differ by seed
    sampled = [_chat(greedy_by_default_server, seed=s, top_k=-1) for s in (1, 2)]
    assert sampled[0] != sampled[1]


def test_generate_keeps_the_apis_defaults(greedy_by_default_server):
    body = {"input_ids": list(range(5, 25)), "sampling_params": {"max_new_tokens": 12}}
    outputs = [greedy_by_default_server.generate({**body, "sampling_params": {**body["sampling_params"], "seed": s}})
               for s in (1, 2)]
    assert outputs[0]["output_ids"] != outputs[1]["output_ids"]

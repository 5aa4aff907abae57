"""return_hidden_states over HTTP: last-layer hidden states (after the final norm), one row per
output token, prompt rows from logprob_start_len when asked, equal to transformers' on the same
checkpoint, also with chunked prefill, forced retraction and streaming."""
from __future__ import annotations

import numpy as np
import orjson
import pytest
import requests
import torch

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113] * 4  # 40 tokens: three chunks of 16


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()


def _hf_rows(hf, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].numpy()


def _generate(server, max_new: int, **extra) -> dict:
    return server.generate({"input_ids": PROMPT, "return_hidden_states": True, **extra,
                            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})


@pytest.mark.parametrize("name", ["tiny", "tiny_overlap_chunked_retract"])
def test_hidden_states_match_transformers(servers, hf_tiny, name):
    server = servers(name)
    out = _generate(server, 12)
    rows = np.asarray(out["meta_info"]["hidden_states"], np.float32)
    ids = PROMPT + out["output_ids"]
    ref = _hf_rows(hf_tiny, ids[:-1])
    p = len(PROMPT)
    assert rows.shape == (12, ref.shape[1])  # one row per output token: the row that sampled it
    # 1e-3, not the 1e-4 of the logits tests: these are pre-head rows, summed by the server's packed
    # GEMMs in other batch shapes (chunks, retraction) than HF's one eager pass, and larger in magnitude
    np.testing.assert_allclose(rows, ref[p - 1:], atol=1e-3, rtol=1e-3)
    with_prompt = _generate(server, 12, logprob_start_len=3)
    rows = np.asarray(with_prompt["meta_info"]["hidden_states"], np.float32)
    assert with_prompt["output_ids"] == out["output_ids"]
    assert rows.shape[0] == (p - 1 - 3) + 12  # prompt positions [3, p-1), then the output rows
    np.testing.assert_allclose(rows, ref[3:], atol=1e-3, rtol=1e-3)


def test_prefill_only_and_not_asked(tiny_server, hf_tiny):
    out = _generate(tiny_server, 0)
    rows = np.asarray(out["meta_info"]["hidden_states"], np.float32)
    assert out["output_ids"] == [] and rows.shape[0] == 1  # the last prompt position, like its logprob
    np.testing.assert_allclose(rows, _hf_rows(hf_tiny, PROMPT)[-1:], atol=1e-3, rtol=1e-3)
    plain = tiny_server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert "hidden_states" not in plain["meta_info"]


def test_streaming_hidden_states_stay_aligned_with_tokens(tiny_server):
    resp = requests.post(tiny_server.url + "/generate", stream=True, timeout=120, json={
        "input_ids": PROMPT, "return_hidden_states": True, "stream": True,
        "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}})  # enough for >1 chunk
    chunks = [orjson.loads(line[6:]) for line in resp.iter_lines() if line and line != b"data: [DONE]"]
    assert len(chunks) >= 2
    for c in chunks:
        assert len(c["meta_info"]["hidden_states"]) == len(c["output_ids"])
    assert len(chunks[-1]["output_ids"]) == 120


def test_n_choices_and_batches_each_get_their_rows(tiny_server):
    out = tiny_server.generate({"input_ids": [PROMPT, PROMPT[:7]], "return_hidden_states": [True, False],
                                "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "n": 2}})
    assert [len(o["meta_info"].get("hidden_states", [])) for o in out] == [3, 3, 0, 0]

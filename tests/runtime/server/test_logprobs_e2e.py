"""Logprobs end to end: values against transformers, formats, and token/logprob alignment."""
from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson
import pytest
import requests
import torch

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(300)
# fp32 on both sides, same weights; the logits agree to ~1e-4 (see test_model_vs_hf), and a
# log-softmax over 49k entries adds rounding of the same order.
LOGPROB_ATOL = 2e-3


def test_input_and_output_logprobs_match_transformers(smol_server, hf_smol, smol_tokenizer):
    text = "The capital of France is"
    out = smol_server.generate({"text": text, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
                                "token_ids_logprob": [7042, 30], "return_text_in_logprobs": True,
                                "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    meta = out["meta_info"]
    prompt = smol_tokenizer(text)["input_ids"]
    full = prompt + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([full])).logits[0].float(), -1)
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == len(prompt) and len(outp) == len(out["output_ids"])
    assert inp[0][0] is None and meta["input_top_logprobs"][0] is None
    for pos in range(1, len(prompt)):
        lp, tok, txt = inp[pos]
        assert tok == prompt[pos] and abs(lp - ref[pos - 1, tok].item()) < LOGPROB_ATOL
        assert txt == smol_tokenizer.decode([tok])
        top_vals, top_ids = ref[pos - 1].topk(3)
        assert [t[1] for t in meta["input_top_logprobs"][pos]] == top_ids.tolist()
        assert np.allclose([t[0] for t in meta["input_top_logprobs"][pos]], top_vals.numpy(), atol=LOGPROB_ATOL)
    for i, (lp, tok, _) in enumerate(outp):
        row = ref[len(prompt) - 1 + i]
        assert tok == out["output_ids"][i] and abs(lp - row[tok].item()) < LOGPROB_ATOL
        assert meta["output_top_logprobs"][i][0][1] == tok  # greedy: the sampled token is the top one
        ids_lp = meta["output_token_ids_logprobs"][i]
        assert [t[1] for t in ids_lp] == [7042, 30]
        assert np.allclose([t[0] for t in ids_lp], [row[7042].item(), row[30].item()], atol=LOGPROB_ATOL)


def test_sampled_logprobs_are_of_the_biased_temperature_scaled_distribution(smol_server, hf_smol, smol_tokenizer):
    # SGLang's default: log_softmax((logits + bias) / temperature) at each sampled token; the
    # default logprob_start_len (-1) reports the last prompt token alone, as a None entry
    text, bias, temperature = "The capital of France is", {30: 3.0, 7042: -2.0}, 0.5
    out = smol_server.generate({"text": text, "return_logprob": True, "top_logprobs_num": 2,
                                "sampling_params": {"max_new_tokens": 6, "temperature": temperature, "seed": 3,
                                                    "logit_bias": {str(k): v for k, v in bias.items()}}})
    meta = out["meta_info"]
    prompt = smol_tokenizer(text)["input_ids"]
    assert meta["input_token_logprobs"] == [[None, prompt[-1], None]] and meta["input_top_logprobs"] == [None]
    with torch.no_grad():
        logits = hf_smol(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
    logits[:, list(bias)] += torch.tensor(list(bias.values()))
    ref = torch.log_softmax(logits / temperature, -1)
    for i, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp - row[tok].item()) < 2 * LOGPROB_ATOL  # dividing by 0.5 doubles the logits' error
        assert np.allclose([t[0] for t in meta["output_top_logprobs"][i]], row.topk(2).values.numpy(),
                           atol=2 * LOGPROB_ATOL)


def _scoring_body(**flags) -> dict:
    return {"text": "Scoring a long prompt for distillation " * 8, "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **flags}


def test_flat_and_b64_formats_match_nested(smol_server):
    nested = smol_server.generate(_scoring_body())["meta_info"]
    flat = smol_server.generate(_scoring_body(return_flat_raw_top_logprobs=True,
                                              return_flat_raw_output_top_logprobs=True))["meta_info"]
    b64 = smol_server.generate(_scoring_body(return_flat_raw_top_logprobs=True, return_flat_raw_output_top_logprobs=True,
                                             return_flat_raw_top_logprobs_b64=True))["meta_info"]
    assert "input_top_logprobs" not in flat and "output_top_logprobs" not in flat
    for side in ("input", "output"):
        rows = [r for r in nested[f"{side}_top_logprobs"] if r is not None]
        null = len(nested[f"{side}_top_logprobs"]) - len(rows)
        k = 2
        assert flat[f"{side}_top_logprobs_shape"] == [len(rows), k]
        assert flat[f"{side}_top_logprobs_null_prefix"] == null
        vals, idx = flat[f"{side}_top_logprobs_val_flat"], flat[f"{side}_top_logprobs_idx_flat"]
        for i, row in enumerate(nested[f"{side}_top_logprobs"]):
            for j in range(k if row is not None else 0):
                assert idx[(i - null) * k + j] == row[j][1]
                assert vals[(i - null) * k + j] == pytest.approx(row[j][0], abs=1e-6)
        shape = b64[f"{side}_top_logprobs_shape"]
        v = np.frombuffer(base64.b64decode(b64[f"{side}_top_logprobs_val_flat_b64"]), b64[f"{side}_top_logprobs_val_flat_b64_dtype"])
        ix = np.frombuffer(base64.b64decode(b64[f"{side}_top_logprobs_idx_flat_b64"]), b64[f"{side}_top_logprobs_idx_flat_b64_dtype"])
        assert np.allclose(v.reshape(shape), np.asarray(vals, np.float32).reshape(shape))
        assert (ix.reshape(shape) == np.asarray(idx).reshape(shape)).all()


@pytest.mark.parametrize("body,field", [
    ({"return_flat_raw_top_logprobs_b64": True}, "return_flat_raw_top_logprobs_b64"),
    ({"return_flat_raw_output_top_logprobs": True, "stream": True}, "return_flat_raw_output_top_logprobs"),
    ({"logprob_start_len": 10_000}, "logprob_start_len"),
])
def test_logprob_format_errors_are_400(tiny_server, body, field):
    resp = tiny_server.post("/generate", {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 2, **body})
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]


def test_prefill_only_request_returns_its_one_logprob(tiny_server):
    out = tiny_server.generate({"input_ids": [5, 6, 7, 8], "return_logprob": True, "logprob_start_len": 0,
                                "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 0}})
    meta = out["meta_info"]
    assert out["output_ids"] == [] and len(meta["input_token_logprobs"]) == 4
    assert len(meta["output_token_logprobs"]) == 1


def _alignment_round(server, stream: bool) -> None:
    bodies = [{"input_ids": [100 + i] * (5 + i % 7), "return_logprob": True, "top_logprobs_num": 1,
               "logprob_start_len": -1 if i % 2 else 0,
               "sampling_params": {"max_new_tokens": 20 + i % 9, "temperature": 0, "ignore_eos": True}}
              for i in range(32)]

    def run(body: dict) -> None:
        if not stream:
            out = server.generate(body)
            meta = out["meta_info"]
            assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) == meta["completion_tokens"]
            assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
            return
        resp = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120)
        chunks = [orjson.loads(line[6:]) for line in resp.iter_lines() if line and line != b"data: [DONE]"]
        for c in chunks:
            assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"])
        assert len(chunks[-1]["output_ids"]) == body["sampling_params"]["max_new_tokens"]

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(run, bodies))


def test_logprob_alignment_under_forced_retraction(servers):
    server = servers("tiny_overlap_chunked_retract")
    for _ in range(5):
        _alignment_round(server, stream=False)
    _alignment_round(server, stream=True)
    assert server.info()["num_retractions"] > 0
    assert_no_leaks(server)


def test_n_and_batch_with_logprobs_keep_per_choice_alignment(tiny_server):
    out = tiny_server.generate({"input_ids": [[5, 6, 7], [8, 9]], "return_logprob": True, "top_logprobs_num": 2,
                                "sampling_params": {"max_new_tokens": 7, "temperature": 1.0, "n": 2, "ignore_eos": True}})
    assert len(out) == 4
    for o in out:
        assert [t[1] for t in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]
        assert len(o["meta_info"]["output_top_logprobs"]) == 7

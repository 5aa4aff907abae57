"""Speculative decoding (NGRAM) end to end: token for token what plain decoding gives, greedy and
seeded, with logprobs, across overlap, chunked prefill and forced retraction; finishing inside an
accepted run; n>1; guided requests; the disable batch size; abort mid-verify; SmolLM2."""
from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(600)

LOOPY = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7] * 3, [20, 21, 22, 23] * 5, list(range(30, 60)),
         [1, 2, 3, 1, 2, 3, 1, 2] * 3, [44] * 40]

BATCH = {
    "input_ids": [*LOOPY, LOOPY[0]],
    "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": -1,
    "sampling_params": [
        {"temperature": 0, "max_new_tokens": 40},
        {"temperature": 0, "max_new_tokens": 17, "ignore_eos": True},
        {"temperature": 0.9, "seed": 3, "max_new_tokens": 30},
        {"temperature": 0.7, "top_p": 0.9, "seed": 11, "max_new_tokens": 25, "n": 3},
        {"temperature": 0, "max_new_tokens": 33, "frequency_penalty": 0.5},  # penalties: never drafts
        # sampling between the two likeliest tokens: the loop's drafts are rejected about half the time
        {"temperature": 1.0, "top_k": 2, "seed": 5, "max_new_tokens": 40},
    ],
}
# one pass over a run vs one pass per token: the same math summed in another order (fp32; SmolLM2's
# 30 layers drift more than the tiny model's two)
TOLERANCE = 1e-3
SPEC_SERVERS = ("tiny_ngram", "tiny_ngram_sequential_chunked_retract", "tiny_ngram_overlap_chunked_retract",
                "tiny_standalone", "tiny_standalone_sequential_retract", "tiny_standalone_overlap_chunked_retract")


def _view(outs: list[dict]) -> list[tuple]:
    return [(o["output_ids"], o["meta_info"]["finish_reason"],
             [t[0] for t in o["meta_info"]["output_token_logprobs"]],
             [[t[1] for t in top] for top in o["meta_info"]["output_top_logprobs"]]) for o in outs]


def _close(a: list[tuple], b: list[tuple]) -> None:
    for (ids_a, fin_a, lp_a, top_a), (ids_b, fin_b, lp_b, top_b) in zip(a, b, strict=True):
        assert ids_a == ids_b and fin_a == fin_b
        assert len(lp_a) == len(lp_b) == len(ids_a) and top_a == top_b  # aligned, same top-k ids
        assert max((abs(x - y) for x, y in zip(lp_a, lp_b)), default=0.0) < TOLERANCE


def test_outputs_and_logprobs_equal_plain_decoding(servers):
    plain = _view(servers("tiny").generate(BATCH))
    accept = []
    for name in SPEC_SERVERS:  # each server checked while it is up (the fixture stops idle ones)
        server = servers(name)
        outs = server.generate(BATCH)
        _close(plain, _view(outs))
        accept.append([o["meta_info"].get("spec_accept_length", 0) for o in outs])
        if name in ("tiny_ngram", "tiny_standalone"):
            sampled = server.generate(BATCH)[-1]["meta_info"]
            assert 0.05 < sampled["spec_accept_rate"] < 0.6, (name, sampled)  # drafts both accepted and rejected
        if name == "tiny_ngram":
            info = server.info()
            assert info["avg_spec_accept_length"] > 1.0 and 0 < info["spec_accept_rate"] <= 1.0, info
            assert info["internal_states"][0]["avg_spec_accept_length"] == info["avg_spec_accept_length"]  # bench_serving
        assert_no_leaks(server)
    # the drafts were really used (the tiny model loops, so the n-gram lookup hits), and the
    # request with penalties never drafted
    assert all(max(a) > 1.5 for a in accept), accept


def test_finishing_inside_an_accepted_run(servers):
    """EOS (a stop token id), a stop string and max_new_tokens landing mid-run trim exactly where
    plain decoding stops."""
    base = servers("tiny").generate({"input_ids": LOOPY[0], "sampling_params": {"temperature": 0,
                                                                              "max_new_tokens": 40}})
    ids, text = base["output_ids"], base["text"]
    stop_id = ids[9]
    stop_text = text[len(text) // 2:len(text) // 2 + 3]
    cases = [{"stop_token_ids": [stop_id]}, {"stop": [stop_text]}, {"stop": [stop_text], "no_stop_trim": True},
             *({"max_new_tokens": n} for n in (1, 2, 3, 5, 6, 7))]
    body = {"input_ids": [LOOPY[0]] * len(cases),
            "sampling_params": [{"temperature": 0, "max_new_tokens": 40, **c} for c in cases],
            "return_logprob": True}
    want = [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"], len(o["meta_info"]["output_token_logprobs"]))
            for o in servers("tiny").generate(body)]
    for name in ("tiny_ngram", "tiny_ngram_overlap_chunked_retract", "tiny_standalone_overlap_chunked_retract"):
        got = [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"],
                len(o["meta_info"]["output_token_logprobs"])) for o in servers(name).generate(body)]
        assert got == want, name
    assert want[0][2]["type"] == "stop" and len(want[0][0]) < 40 and want[1][2]["type"] == "stop"


def test_guided_requests_share_the_batch(servers):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    body = {"input_ids": LOOPY[:3], "sampling_params": [
        {"temperature": 0, "max_new_tokens": 24, "json_schema": schema},
        {"temperature": 0, "max_new_tokens": 24},
        {"temperature": 0, "max_new_tokens": 8, "choice": ["yes", "no"]}]}
    want = [o["output_ids"] for o in servers("tiny").generate(body)]
    assert [o["output_ids"] for o in servers("tiny_ngram").generate(body)] == want


def test_above_the_disable_batch_size_requests_decode_plainly(servers):
    """Four concurrent requests on a server that speculates only up to two: the same outputs, and
    no verify counted for steps that decoded plainly. The four usually run together throughout (no
    verify at all), but on a loaded machine the first can start decoding, and speculating, before the
    others arrive (CI saw spec fields): so the check is that the verifies stay well below the plain
    steps, each counted as a verify before (4 x 29 = 116), and the server-wide count agrees."""
    server = servers("tiny_ngram_disable_2")
    body = {"input_ids": LOOPY[:4], "sampling_params": {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}}
    want = [o["output_ids"] for o in servers("tiny").generate(body)]
    before = server.info().get("spec_verify_ct", 0)
    outs = server.generate(body)
    assert [o["output_ids"] for o in outs] == want
    verifies = [o["meta_info"].get("spec_verify_ct", 0) for o in outs]
    assert sum(verifies) < 4 * 29 // 2, verifies
    assert server.info().get("spec_verify_ct", 0) - before == sum(verifies)
    single = server.generate({"input_ids": LOOPY[0], "sampling_params": {
        "temperature": 0, "max_new_tokens": 30, "ignore_eos": True}})
    assert single["output_ids"] == want[0] and single["meta_info"]["spec_accept_length"] > 1.0
    assert_no_leaks(server)


def test_plain_decoding_inside_a_verify_is_no_verify(servers):
    """A grammar, penalties or hidden states decode plainly inside the verify pass: as in SGLang,
    where such a request would not be in the verify, they report no speculative counts (they reported
    a verify per step, all drafts rejected). The requests beside them count every decode step."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    server = servers("tiny_ngram")
    plain = [{"json_schema": schema}, {"frequency_penalty": 0.5}, {}]
    body = {"input_ids": [LOOPY[0]] * 5, "return_hidden_states": [False, False, True, False, False],
            "sampling_params": [{"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, **p}
                                for p in [*plain, {}, {"temperature": 0.9, "seed": 2}]]}
    before = server.info().get("spec_verify_ct", 0)
    outs = server.generate(body)
    assert not any(k.startswith("spec_") for o in outs[:3] for k in o["meta_info"]), [o["meta_info"] for o in outs]
    for o in outs[3:]:
        meta = o["meta_info"]
        # the prefill's token, then one verify per step keeping its accepted drafts and one more
        assert meta["completion_tokens"] == 1 + meta["spec_verify_ct"] + meta["spec_accept_token_num"], meta
        assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert server.info()["spec_verify_ct"] - before == sum(o["meta_info"]["spec_verify_ct"] for o in outs[3:])


@pytest.mark.parametrize("name", ["tiny_ngram_overlap_chunked_retract", "tiny_standalone_overlap_chunked_retract"])
def test_abort_mid_verify_leaves_nothing_behind(servers, name):
    server = servers(name)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fut = pool.submit(server.generate, {"input_ids": LOOPY[1], "rid": "spec-abort", "sampling_params": {
            "temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}})
        deadline = time.monotonic() + 60
        while server.info()["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        assert server.post("/abort_request", {"rid": "spec-abort"}).status_code == 200
        out = fut.result(timeout=60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 2000
    assert_no_leaks(server)


def test_smollm2_repeats_a_passage_faster_in_verifies(servers):
    passage = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
               "step. All that glitters is not gold.")
    text = (f"<|im_start|>user\nRepeat this text exactly, word for word:\n{passage}<|im_end|>\n"
            "<|im_start|>assistant\n")
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 48}, "return_logprob": True}
    plain, spec = servers("smol").generate(body), servers("smol_ngram").generate(body)
    assert spec["output_ids"] == plain["output_ids"]
    lp_plain = [t[0] for t in plain["meta_info"]["output_token_logprobs"]]
    lp_spec = [t[0] for t in spec["meta_info"]["output_token_logprobs"]]
    # a verify scores a token in a k-token extend, plain decoding in a 1-token step: other GEMM shapes,
    # another summation order, so equal tokens whose logprobs differ in the 5th digit
    assert max(abs(a - b) for a, b in zip(lp_plain, lp_spec, strict=True)) < 1e-3
    assert spec["meta_info"]["spec_accept_length"] > 2.0, spec["meta_info"]


def test_smollm2_with_a_truncated_draft_model_equals_plain_decoding(servers):
    """A layer-truncated SmolLM2 drafts badly (most drafts are rejected), which is the point: the
    output is plain decoding's whatever the draft proposes."""
    texts = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
             for q in ("Write a short poem about the sea.", "List three fruits.", "Count from one to ten.")]
    body = {"text": texts, "sampling_params": {"temperature": 0, "max_new_tokens": 32}, "return_logprob": True}
    plain, spec = servers("smol").generate(body), servers("smol_standalone").generate(body)
    _close(_view_no_top(plain), _view_no_top(spec))
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in spec)
    assert servers("smol_standalone").info()["spec_verify_ct"] > 0


def _view_no_top(outs: list[dict]) -> list[tuple]:
    return [(o["output_ids"], o["meta_info"]["finish_reason"], [t[0] for t in o["meta_info"]["output_token_logprobs"]],
             []) for o in outs]


def test_spec_meta_info_is_sglangs_on_the_final_chunk_only(servers):
    """SGLang's fill_spec_decoding_meta: drafts proposed are verifies x (speculative_num_draft_tokens
    - 1) whatever the n-gram lookup found, the rate is over them, the histogram counts verifies;
    a stream's earlier chunks carry none of it."""
    server = servers("tiny_ngram")
    body = {"input_ids": LOOPY[0], "sampling_params": {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}}
    meta = server.generate(body)["meta_info"]
    verify_ct = meta["spec_verify_ct"]
    assert verify_ct > 0 and meta["spec_draft_token_num"] == meta["spec_num_proposed_drafts"] == 3 * verify_ct
    assert meta["spec_accept_rate"] == meta["spec_accept_token_num"] / (3 * verify_ct)
    assert sum(meta["spec_accept_histogram"]) == verify_ct and meta["num_retractions"] == 0
    with server.post("/generate", {**body, "stream": True}, stream=True) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith(b"data: {")]
    assert len(chunks) > 1 and "spec_verify_ct" in chunks[-1]["meta_info"]
    assert not any(k.startswith("spec_") for c in chunks[:-1] for k in c["meta_info"])

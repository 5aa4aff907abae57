"""Sampling parameters, seeds, n>1, abort and disconnects, end to end."""
from __future__ import annotations

import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(300)
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def _gen(server, sp: dict, text: str = PROMPT, **extra) -> dict:
    return server.generate({"text": text, "sampling_params": sp, **extra})


def _wait_running(server, n: int, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = server.info()
        if info["num_running_reqs"] + info["num_queue_reqs"] >= n:
            return info
        time.sleep(0.05)
    raise AssertionError(f"never saw {n} requests in flight")


def _wait_idle(server, timeout: float = 2.0) -> float:
    """Seconds until nothing runs or waits any more; fails past `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        info = server.info()
        if info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight after {timeout} s: {server.info()}")


# -- sampling parameters -----------------------------------------------------------------------------
def test_logit_bias_forces_a_token(smol_server):
    out = _gen(smol_server, {"max_new_tokens": 5, "temperature": 0, "logit_bias": {"1000": 100.0}})
    assert out["output_ids"] == [1000] * 5


def test_penalties_reduce_repetition(smol_server):
    text = "one one one one one one one one one one one one one"
    plain = _gen(smol_server, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}, text)
    penal = _gen(smol_server, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True,
                               "frequency_penalty": 2.0, "presence_penalty": 2.0}, text)
    rep = _gen(smol_server, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "repetition_penalty": 2.0}, text)
    distinct = lambda o: len(set(o["output_ids"]))  # noqa: E731
    assert distinct(penal) > distinct(plain) and distinct(rep) > distinct(plain)


def test_top_k_one_and_tiny_top_p_and_min_p_are_greedy(smol_server):
    greedy = _gen(smol_server, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})["output_ids"]
    for narrow in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 0.999}):
        out = _gen(smol_server, {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, **narrow})
        assert out["output_ids"] == greedy, narrow


def test_stop_string_across_tokens_is_trimmed(smol_server):
    full = _gen(smol_server, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    words = full["text"].split()
    stop = " ".join(words[2:4])  # spans several tokens, well inside the output
    out = _gen(smol_server, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and full["text"].startswith(out["text"])
    kept = _gen(smol_server, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stop,
                              "no_stop_trim": True})
    assert kept["text"].endswith(stop)


def test_stop_regex_ends_where_the_pattern_first_matches_untrimmed(smol_server):
    full = _gen(smol_server, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    word = full["text"].split()[3]
    pattern = r"\s" + re.escape(word)  # not a literal of itself: SGLang trims nothing
    out = _gen(smol_server, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": [pattern]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["text"].endswith(word) and full["text"].startswith(out["text"])
    assert len(out["output_ids"]) < 24


def test_stop_token_ids_and_ignore_eos_and_min_new_tokens(smol_server):
    full = _gen(smol_server, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    stop_id = full["output_ids"][3]
    out = _gen(smol_server, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == full["output_ids"][:4]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    chat = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    ends = _gen(smol_server, {"max_new_tokens": 64, "temperature": 0}, chat)
    assert ends["meta_info"]["finish_reason"]["type"] == "stop"
    n = len(ends["output_ids"])
    longer = _gen(smol_server, {"max_new_tokens": 64, "temperature": 0, "min_new_tokens": n + 5}, chat)
    assert len(longer["output_ids"]) >= n + 5
    ignored = _gen(smol_server, {"max_new_tokens": n + 8, "temperature": 0, "ignore_eos": True}, chat)
    assert len(ignored["output_ids"]) == n + 8


def test_requests_finishing_at_the_same_step_by_length_stop_token_and_stop_string(smol_server):
    base = _gen(smol_server, {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
    ids, text = base["output_ids"], base["text"]
    bodies = [
        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [ids[5]]},  # ignore_eos would silence it
        {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
    ]
    with ThreadPoolExecutor(3) as pool:
        by_len, by_tok, running = pool.map(lambda sp: _gen(smol_server, sp), bodies)
    assert by_len["output_ids"] == ids[:6]
    assert by_tok["output_ids"] == ids[:ids.index(ids[5]) + 1]
    assert running["output_ids"] == ids and running["text"] == text


# -- seeds and n > 1 ------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_across_batches(smol_server):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    first = _gen(smol_server, sp)["output_ids"]
    with ThreadPoolExecutor(4) as pool:
        mixed = list(pool.map(lambda i: _gen(smol_server, sp if i == 2 else {"max_new_tokens": 16 + i}), range(4)))
    assert mixed[2]["output_ids"] == first
    assert _gen(smol_server, {**sp, "sampling_seed": None, "seed": 1234})["output_ids"] == first
    unseeded = {_gen(smol_server, {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True})["output_ids"][0:16].__repr__()
                for _ in range(3)}
    assert len(unseeded) > 1


def test_the_whole_64_bit_seed_counts(smol_server):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    low = _gen(smol_server, {**sp, "sampling_seed": 7})["output_ids"]
    high = _gen(smol_server, {**sp, "sampling_seed": 7 + 2**32})["output_ids"]
    assert low != high  # a seed masked to 32 bits would sample the same tokens
    top = {**sp, "sampling_seed": 2**63 - 1, "n": 2}  # choice 1 wraps to -2**63, still an int64
    first, again = _gen(smol_server, top), _gen(smol_server, top)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert first[0]["output_ids"] != first[1]["output_ids"]


def test_n4_one_logical_rid_shared_prefix_and_abort(smol_server):
    _wait_idle(smol_server)
    assert smol_server.post("/flush_cache").status_code == 200  # earlier tests cached PROMPT
    out = smol_server.generate({"text": PROMPT * 3, "rid": "nreq", "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "n": 4}})
    assert isinstance(out, list) and len(out) == 4
    assert {o["meta_info"]["id"] for o in out} == {"nreq"} and sorted(o["index"] for o in out) == [0, 1, 2, 3]
    cached = sorted(o["meta_info"]["cached_tokens"] for o in out)
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    # abort of the logical rid reaches all four choices
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(smol_server.generate, {"text": PROMPT, "rid": "nabort", "sampling_params": {
            "max_new_tokens": 2000, "temperature": 1.0, "n": 4, "ignore_eos": True}})
        _wait_running(smol_server, 4)
        assert smol_server.post("/abort_request", {"rid": "nabort"}).status_code == 200
        res = fut.result(timeout=30)
    assert len(res) == 4 and all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in res)
    assert all(len(r["output_ids"]) < 2000 for r in res)
    _wait_idle(smol_server)
    assert_no_leaks(smol_server)


# -- abort and disconnect ---------------------------------------------------------------------------------
def test_abort_running_queued_and_all(servers):
    server = servers("tiny_overlap_chunked_retract")
    long_sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(server.generate, {"input_ids": [7 + i] * (200 if i == 0 else 10), "rid": f"ab-{i}",
                                              "sampling_params": long_sp}) for i in range(6)]
        _wait_running(server, 6)
        server.post("/abort_request", {"rid": "ab-0"})  # likely still in chunked prefill (200 tokens, chunk 16)
        server.post("/abort_request", {"rid": "ab-1"})
        assert futs[0].result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        assert futs[1].result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        assert server.post("/abort_request", {"rid": ""}).status_code == 200  # aborts nothing
        time.sleep(0.3)
        assert all(not f.done() for f in futs[2:])
        server.post("/abort_request", {"abort_all": True})
        results = [f.result(30) for f in futs]
    for r in results:
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(r["output_ids"]) == r["meta_info"]["completion_tokens"] < 1500
    _wait_idle(server)
    assert_no_leaks(server)


def test_client_disconnect_aborts_streaming_and_non_streaming(tiny_server):
    body = {"input_ids": [11] * 10, "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    resp = requests.post(tiny_server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60)
    lines = resp.iter_lines()
    next(lines)
    _wait_running(tiny_server, 1)
    resp.close()
    _wait_idle(tiny_server, timeout=3.0)  # aborted, not run to its end: it fails past the timeout
    host, port = tiny_server.url.removeprefix("http://").split(":")
    payload = requests.models.complexjson.dumps(body).encode()
    raw = socket.create_connection((host, int(port)))
    raw.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    _wait_running(tiny_server, 1)
    raw.close()
    _wait_idle(tiny_server, timeout=3.0)  # aborted, not run to its end: it fails past the timeout
    assert_no_leaks(tiny_server)


def test_priority_orders_admission_when_full(tmp_path, tiny_model_dir):
    from server_utils import start_server

    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--max-running-requests", "1", "--enable-priority-scheduling",
                           "--disable-priority-preemption",  # admission order alone
                           "--default-priority-value", "7"],  # SGLang's: the priority of a request naming none
                          str(tmp_path / "p.log"),
                          env={"TANDEM_TEST_FORWARD_HANG": "0.01"})  # requests end >= 40 ms apart: the client sees the order
    try:
        order: list[str] = []
        lock = threading.Lock()

        def run(rid: str, priority: int | None, max_new: int) -> None:
            server.generate({"input_ids": [9] * 5, "rid": rid, "priority": priority,
                             "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}})
            with lock:
                order.append(rid)

        with ThreadPoolExecutor(5) as pool:
            pool.submit(run, "blocker", 0, 1500)
            _wait_running(server, 1)
            for rid, prio in (("low", 1), ("high", 10), ("none", None), ("mid", 5)):
                pool.submit(run, rid, prio, 4)
            _wait_running(server, 5)  # all four queued behind the blocker, whatever the machine's speed
            server.post("/abort_request", {"rid": "blocker"})
        assert order == ["blocker", "high", "none", "mid", "low"]
    finally:
        server.stop()


def _stream_chunks(server, body: dict) -> list[dict]:
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120) as resp:
        assert resp.status_code == 200, resp.text
        return [requests.models.complexjson.loads(line[6:]) for line in resp.iter_lines()
                if line.startswith(b"data: {")]


def test_priority_preemption_requeues_the_running_request(tmp_path, tiny_model_dir):
    """The preempted request is requeued and ends with the output it gives alone; its streaming
    client sees every token once, each with its logprob and top logprobs, across the retraction."""
    from server_utils import start_server

    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--max-running-requests", "1", "--enable-priority-scheduling"],  # preempts by default
                          str(tmp_path / "pp.log"), env={"TANDEM_TEST_FORWARD_HANG": "0.01"})  # low runs >= 3 s
    try:
        low_body = {"input_ids": [9] * 5, "rid": "low", "priority": 0, "return_logprob": True, "top_logprobs_num": 2,
                    "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}
        reference = server.generate({**low_body, "rid": "low-ref"})
        done: list[str] = []
        with ThreadPoolExecutor(2) as pool:
            low = pool.submit(lambda: (_stream_chunks(server, low_body), done.append("low"))[0])
            _wait_running(server, 1)
            time.sleep(0.3)
            high = pool.submit(lambda: (server.generate({"input_ids": [8] * 5, "rid": "high", "priority": 50,
                                                         "sampling_params": {"max_new_tokens": 3, "temperature": 0}}),
                                        done.append("high"))[0])
            chunks = low.result(60)
            high.result(60)
        assert done == ["high", "low"]
        assert server.info()["num_retractions"] >= 1
        for before, after in zip(chunks, chunks[1:]):  # cumulative: nothing sent twice or taken back
            assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        for chunk in chunks:
            meta = chunk["meta_info"]
            assert [t[1] for t in meta["output_token_logprobs"]] == chunk["output_ids"]
            assert len(meta["output_top_logprobs"]) == meta["completion_tokens"] == len(chunk["output_ids"])
        final = chunks[-1]
        assert final["output_ids"] == reference["output_ids"]  # retracted, requeued, not lost
        assert final["text"] == reference["text"]
        for got, want in zip(final["meta_info"]["output_token_logprobs"], reference["meta_info"]["output_token_logprobs"]):
            assert got[1] == want[1] and got[0] == pytest.approx(want[0], abs=1e-4)
        assert_no_leaks(server)
    finally:
        server.stop()

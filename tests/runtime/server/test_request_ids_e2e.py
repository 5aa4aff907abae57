"""Request ids over HTTP: n>1 choices never collide with other requests, aborts are exact, a
leaving client's handler ends, and an abort racing a cache flush never hurts the server."""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(300)
GREEDY_LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}


def _wait(server, predicate, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = server.info()
        if predicate(info):
            return info
        time.sleep(0.05)
    raise AssertionError(f"condition not reached: {server.info()}")


def _in_flight(n: int):
    return lambda info: info["num_running_reqs"] + info["num_queue_reqs"] >= n


def _idle(info: dict) -> bool:
    return info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0


def _reference(server, ids: list[int], max_new: int) -> list[int]:
    sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    return server.generate({"input_ids": ids, "sampling_params": sp})["output_ids"]


def test_a_rid_that_looks_like_another_requests_choice_does_not_collide(tiny_server):
    a_ids, b_ids = [101, 102, 103, 104], [201, 202, 203]
    ref_a, ref_b = _reference(tiny_server, a_ids, 120), _reference(tiny_server, b_ids, 6)
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(tiny_server.generate, {"input_ids": a_ids, "rid": "abc", "sampling_params": {
            "max_new_tokens": 120, "temperature": 0, "ignore_eos": True, "n": 2}})
        _wait(tiny_server, _in_flight(2))
        b = tiny_server.generate({"input_ids": b_ids, "rid": "abc_1", "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
        a_out = a.result(60)
    assert b["meta_info"]["id"] == "abc_1" and b["output_ids"] == ref_b
    assert [o["meta_info"]["id"] for o in a_out] == ["abc", "abc"] and [o["index"] for o in a_out] == [0, 1]
    assert all(o["output_ids"] == ref_a for o in a_out)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in a_out)


def test_a_batch_whose_rids_look_like_each_others_choices(tiny_server):
    a_ids, b_ids = [111, 112, 113], [211, 212]
    ref_a, ref_b = _reference(tiny_server, a_ids, 5), _reference(tiny_server, b_ids, 7)
    out = tiny_server.generate({"input_ids": [a_ids, b_ids], "rid": ["a", "a_1"], "sampling_params": [
        {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2},
        {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True}]})
    assert [(o["index"], o["meta_info"]["id"]) for o in out] == [(0, "a"), (1, "a"), (2, "a_1")]
    assert [o["output_ids"] for o in out] == [ref_a, ref_a, ref_b]


def test_abort_by_rid_is_exact(tiny_server):
    with ThreadPoolExecutor(3) as pool:
        short = pool.submit(tiny_server.generate, {"input_ids": [7, 8], "rid": "req1", "sampling_params": GREEDY_LONG})
        longer = pool.submit(tiny_server.generate, {"input_ids": [7, 9], "rid": "req10", "sampling_params": GREEDY_LONG})
        anon = pool.submit(tiny_server.generate, {"input_ids": [7, 10], "sampling_params": GREEDY_LONG})  # uuid rid
        _wait(tiny_server, _in_flight(3))
        for unknown in ("req", "a", "0", "req1_0"):  # prefixes and internal-looking names abort nothing
            assert tiny_server.post("/abort_request", {"rid": unknown}).status_code == 200
        assert tiny_server.post("/abort_request", {"rid": "req1"}).status_code == 200
        assert short.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        time.sleep(0.5)
        assert not longer.done() and not anon.done()
        tiny_server.post("/abort_request", {"rid": "req10"})
        assert longer.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        assert not anon.done()
        tiny_server.post("/abort_request", {"abort_all": True})
        assert anon.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
    _wait(tiny_server, _idle)


def _send_raw(server, body: dict) -> socket.socket:
    """POST /generate on a raw socket, so the test can hang up without reading the answer."""
    host, port = server.url.removeprefix("http://").split(":")
    payload = requests.models.complexjson.dumps(body).encode()
    raw = socket.create_connection((host, int(port)))
    raw.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return raw


def test_after_a_client_leaves_its_handler_ends_and_aborts_nothing_else(tiny_server):
    # "gone" (n=2) runs while a request named like its second choice comes and goes; then the
    # client of "gone" hangs up. Its handler must end at once: a handler left waiting would keep
    # aborting by its rid, and later requests named "gone..." (or "gone" itself) would die.
    raw = _send_raw(tiny_server, {"input_ids": [13] * 6, "rid": "gone", "sampling_params": {**GREEDY_LONG, "n": 2}})
    _wait(tiny_server, _in_flight(2))
    tiny_server.generate({"input_ids": [12] * 3, "rid": "gone_1", "sampling_params": {"max_new_tokens": 2}})
    raw.close()
    _wait(tiny_server, _idle, timeout=3.0)
    time.sleep(1.2)
    sp = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(tiny_server.generate, {"input_ids": [14 + i] * 6, "rid": rid, "sampling_params": sp})
                for i, rid in enumerate(("gone", "gone_1", "gone_again"))]
        for fut in futs:
            assert fut.result(60)["meta_info"]["finish_reason"]["type"] == "length"
    assert_no_leaks(tiny_server)


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.02, 0.04, 0.06, 0.1])
def test_abort_then_flush_at_once_never_crashes_the_server(smol_server, delay):
    # The first abort releases a request row while a step is in flight; the next step launches
    # holding that release; a flush accepted before that step is processed used to free the row
    # twice. The delay walks the second abort + flush across that window (a step is ~50 ms here).
    sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(smol_server.generate, {"text": f"Count to a thousand, round {i}.", "rid": f"fl-{delay}-{i}",
                                                   "sampling_params": sp}) for i in range(2)]
        _wait(smol_server, lambda info: info["num_running_reqs"] >= 2, timeout=30)
        time.sleep(0.2)  # both decoding
        smol_server.post("/abort_request", {"rid": f"fl-{delay}-0"})
        time.sleep(delay)
        smol_server.post("/abort_request", {"rid": f"fl-{delay}-1"})
        flush = smol_server.post("/flush_cache")
        assert flush.status_code in (200, 400), flush.text
        assert all(f.result(30)["meta_info"]["finish_reason"]["type"] == "abort" for f in futs)
    assert smol_server.proc.poll() is None, smol_server.log()[-3000:]
    assert smol_server.get("/health").status_code == 200
    _wait(smol_server, _idle)
    assert_no_leaks(smol_server)


def test_when_one_choice_fails_its_siblings_are_aborted_and_the_call_fails(tmp_path, tiny_model_dir):
    from server_utils import start_server

    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--max-running-requests", "1", "--max-queued-requests", "2"], str(tmp_path / "q.log"))
    try:
        with ThreadPoolExecutor(1) as pool:
            blocker = pool.submit(server.generate, {"input_ids": [9] * 4, "rid": "blocker", "sampling_params": GREEDY_LONG})
            _wait(server, lambda info: info["num_running_reqs"] == 1)
            # choices 0 and 1 fill the queue, choices 2 and 3 are refused: the call ends with that error
            body = {"input_ids": [8] * 4, "rid": "four", "sampling_params": {"max_new_tokens": 4, "n": 4}}
            resp = server.post("/generate", body)
            assert resp.status_code == 503 and "The request queue is full." in resp.json()["error"]["message"]
            _wait(server, lambda info: info["num_queue_reqs"] == 0, timeout=3.0)  # the queued siblings left
            stream = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60)
            events = [line for line in stream.iter_lines() if line]
            assert b"The request queue is full." in events[-2] and events[-1] == b"data: [DONE]"
            # SGLang's shape: the failed request's last chunk, its finish_reason an abort with the status
            last = json.loads(events[-2].removeprefix(b"data: "))
            assert last["meta_info"]["finish_reason"]["status_code"] == 503 and "text" in last
            _wait(server, lambda info: info["num_queue_reqs"] == 0, timeout=3.0)
            # guided choices wait for their grammar outside the queue, and count once they join it
            # (SGLang checks the limit then): the third of three is refused, not queued past the limit
            guided = {"input_ids": [7] * 4, "sampling_params": {"max_new_tokens": 4, "n": 3, "regex": "[ab]{4}"}}
            resp = server.post("/generate", guided, timeout=20)
            assert resp.status_code == 503 and "The request queue is full." in resp.json()["error"]["message"]
            _wait(server, lambda info: info["num_queue_reqs"] == 0, timeout=3.0)
            assert not blocker.done()
            server.post("/abort_request", {"rid": "blocker"})
            assert blocker.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        assert_no_leaks(server)
    finally:
        server.stop()


def test_a_full_queue_gives_way_to_a_more_urgent_request(tmp_path, tiny_model_dir):
    """--enable-priority-scheduling: the least urgent waiting request is aborted with a 503 to make
    room for a more urgent arrival (SGLang's _abort_on_queued_limit); a less urgent one is refused."""
    from server_utils import start_server

    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--max-running-requests", "1", "--max-queued-requests", "1",
                           "--enable-priority-scheduling"], str(tmp_path / "p.log"))
    try:
        with ThreadPoolExecutor(3) as pool:
            blocker = pool.submit(server.generate, {"input_ids": [9] * 4, "rid": "blocker", "priority": 10,
                                                    "sampling_params": GREEDY_LONG})
            _wait(server, lambda info: info["num_running_reqs"] == 1)
            low = pool.submit(server.post, "/generate", {"input_ids": [8] * 4, "priority": 0,
                                                          "sampling_params": {"max_new_tokens": 2}})
            _wait(server, lambda info: info["num_queue_reqs"] == 1)
            lower = server.post("/generate", {"input_ids": [7] * 4, "priority": -3, "sampling_params": {"max_new_tokens": 2}})
            assert lower.status_code == 503 and "The request queue is full." in lower.json()["error"]["message"]
            high = {"input_ids": [6] * 4, "rid": "high", "priority": 5, "sampling_params": {"max_new_tokens": 2}}
            high_call = pool.submit(server.post, "/generate", high)
            evicted = low.result(30)
            assert evicted.status_code == 503 and "higher priority request" in evicted.json()["error"]["message"]
            server.post("/abort_request", {"rid": "blocker"})
            assert high_call.result(30).status_code == 200 and blocker.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        assert_no_leaks(server)
    finally:
        server.stop()

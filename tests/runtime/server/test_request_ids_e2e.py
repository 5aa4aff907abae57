"""Request ids over HTTP: n>1 choices never collide with other requests, aborts are exact, a
leaving client's handler ends, and an abort racing a cache flush never hurts the server."""
from __future__ import annotations

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


def test_after_a_client_leaves_its_rid_is_free_and_nothing_else_is_aborted(tiny_server):
    host, port = tiny_server.url.removeprefix("http://").split(":")
    payload = requests.models.complexjson.dumps({"input_ids": [13] * 6, "rid": "gone", "sampling_params": {
        **GREEDY_LONG, "n": 2}}).encode()
    raw = socket.create_connection((host, int(port)))
    raw.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    _wait(tiny_server, _in_flight(2))
    raw.close()
    _wait(tiny_server, _idle, timeout=3.0)
    time.sleep(1.2)  # a handler that lingered would keep aborting by this rid (or prefix) meanwhile
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        reused = pool.submit(tiny_server.generate, {"input_ids": [14] * 6, "rid": "gone", "sampling_params": sp})
        prefixed = pool.submit(tiny_server.generate, {"input_ids": [15] * 6, "rid": "gone_1", "sampling_params": sp})
        for fut in (reused, prefixed):
            assert fut.result(60)["meta_info"]["finish_reason"]["type"] == "length"
    assert_no_leaks(tiny_server)


def test_abort_then_flush_at_once_never_crashes_the_server(tiny_server):
    for round_ in range(5):
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(tiny_server.generate, {"input_ids": [20 + round_, 30 + i] * 8, "rid": f"fl-{round_}-{i}",
                                                      "sampling_params": GREEDY_LONG}) for i in range(2)]
            _wait(tiny_server, lambda info: info["num_running_reqs"] >= 2)
            tiny_server.post("/abort_request", {"rid": f"fl-{round_}-0"})
            tiny_server.post("/abort_request", {"rid": f"fl-{round_}-1"})
            flush = tiny_server.post("/flush_cache")
            assert flush.status_code in (200, 400), flush.text
            assert all(f.result(30)["meta_info"]["finish_reason"]["type"] == "abort" for f in futs)
        assert tiny_server.proc.poll() is None, tiny_server.log()[-3000:]
        assert tiny_server.get("/health").status_code == 200
    _wait(tiny_server, _idle)
    assert_no_leaks(tiny_server)

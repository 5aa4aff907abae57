"""Control requests against a frozen scheduler: a clear 503 in bounded time, and afterwards
every reply answers its own request (none is one call stale); /health_generate against a
frozen detokenizer; and a busy server is healthy."""
from __future__ import annotations

import os
import signal
import time

import pytest

from server_utils import start_server

pytestmark = pytest.mark.timeout(180)


def test_a_frozen_scheduler_gets_503s_and_no_reply_is_stale_afterwards(tmp_path, tiny_model_dir):
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--health-generate-timeout", "2"], str(tmp_path / "server.log"))
    try:
        scheduler = server.info()["scheduler_pid"]
        steps_before = server.info()["num_steps"]
        os.kill(scheduler, signal.SIGSTOP)
        try:
            resp = server.get("/get_server_info")
            assert resp.status_code == 503 and "did not answer" in resp.json()["error"]["message"]
            resp = server.get("/health_generate")
            assert resp.status_code == 503 and "did not finish within 2 s" in resp.json()["error"]["message"]
        finally:
            os.kill(scheduler, signal.SIGCONT)
        time.sleep(0.5)  # the late reply to the timed-out request arrives now, and must be dropped
        out = server.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
        assert len(out["output_ids"]) == 6
        assert server.info()["num_steps"] > steps_before + 5  # a stale reply would show the old count
        assert server.post("/flush_cache").status_code == 200
        assert server.get("/health_generate").status_code == 200
        # a hung detokenizer: the scheduler still steps (the probe's own prefill), but no output
        # comes back, and that is no health
        detokenizer = server.info()["detokenizer_pid"]
        os.kill(detokenizer, signal.SIGSTOP)
        try:
            resp = server.get("/health_generate")
            assert resp.status_code == 503 and "did not finish within 2 s" in resp.json()["error"]["message"]
        finally:
            os.kill(detokenizer, signal.SIGCONT)
        assert server.get("/health_generate").status_code == 200
    finally:
        server.stop()


def test_health_generate_waits_its_own_timeout_past_the_control_default(tmp_path, tiny_model_dir):
    """--health-generate-timeout 20 against a frozen scheduler: the 503 comes after 20 s, not after
    the 10 s every other control call waits for a scheduler reply."""
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "2000",
                           "--health-generate-timeout", "20"], str(tmp_path / "server.log"))
    try:
        scheduler = server.info()["scheduler_pid"]
        os.kill(scheduler, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            resp = server.get("/health_generate")
            waited = time.monotonic() - t0
        finally:
            os.kill(scheduler, signal.SIGCONT)
        assert resp.status_code == 503 and "did not finish within 20 s" in resp.json()["error"]["message"], resp.text
        assert waited >= 19.5, waited
        assert server.get("/health_generate").status_code == 200
    finally:
        server.stop()


def test_health_generate_is_ok_on_a_busy_server(tmp_path, tiny_model_dir):
    """Every slot busy with long non-streamed requests (no output for seconds) and the waiting
    queue full, so the probe itself is refused: the server still makes progress, which is health
    (SGLang's check counts any output after it started)."""
    from concurrent.futures import ThreadPoolExecutor

    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "6000",
                           "--max-running-requests", "1", "--max-queued-requests", "1",
                           "--health-generate-timeout", "5"], str(tmp_path / "busy.log"))
    try:
        long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        def wait_for(running: int, queued: int) -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                info = server.info()
                if info["num_running_reqs"] == running and info["num_queue_reqs"] == queued:
                    return
                time.sleep(0.02)
            raise AssertionError(f"never {running} running and {queued} queued: {info}")

        with ThreadPoolExecutor(2) as pool:
            # one after the other: the second arriving while the first still waits would be refused
            calls = [pool.submit(server.post, "/generate", long)]
            wait_for(1, 0)
            calls.append(pool.submit(server.post, "/generate", long))
            wait_for(1, 1)
            resp = server.get("/health_generate")
            server.post("/abort_request", {"abort_all": True})
            assert all(call.result(60).status_code == 200 for call in calls)
        assert resp.status_code == 200, resp.text
    finally:
        server.stop()

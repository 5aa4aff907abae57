"""Control requests against a frozen scheduler: a clear 503 in bounded time, and afterwards
every reply answers its own request (none is one call stale)."""
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
            t0 = time.monotonic()
            resp = server.get("/get_server_info")
            assert resp.status_code == 503 and "did not answer" in resp.json()["error"]["message"]
            assert time.monotonic() - t0 < 15
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
    finally:
        server.stop()

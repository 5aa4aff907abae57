"""A dying scheduler takes the server down loudly: in-flight requests fail, the server exits non-zero."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from server_utils import start_server

pytestmark = pytest.mark.timeout(180)


def test_killing_the_scheduler_fails_inflight_requests_and_exits_nonzero(tmp_path, tiny_model_dir):
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000"],
                          str(tmp_path / "server.log"))
    try:
        pids = server.info()
        results: list[requests.Response | Exception] = []

        def long_request() -> None:
            try:
                results.append(server.post("/generate", {"input_ids": [5] * 20, "sampling_params": {
                    "max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}, timeout=60))
            except Exception as exc:  # the connection may drop as the server exits
                results.append(exc)

        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(1.0)
        os.kill(pids["scheduler_pid"], signal.SIGKILL)
        worker.join(30)
        assert not worker.is_alive(), "the in-flight request hung"
        assert len(results) == 1
        resp = results[0]
        assert isinstance(resp, requests.Response) and resp.status_code == 500, resp
        assert "scheduler" in resp.json()["error"]["message"]
        assert server.proc.wait(15) != 0
        # the detokenizer must not outlive the server
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pids["detokenizer_pid"]):
            time.sleep(0.2)
        assert not _alive(pids["detokenizer_pid"])
    finally:
        server.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); read its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_sigterm_shuts_down_cleanly(tmp_path, tiny_model_dir):
    import glob
    import tempfile

    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "2000"],
                          str(tmp_path / "server.log"))
    try:
        pids = server.info()
        assert glob.glob(os.path.join(tempfile.gettempdir(), f"tandem-{server.proc.pid}-*"))
        server.proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status says SIGTERM
        assert server.proc.wait(30) in (0, -signal.SIGTERM)
        for key in ("scheduler_pid", "detokenizer_pid"):
            assert not _alive(pids[key]), key
        assert not glob.glob(os.path.join(tempfile.gettempdir(), f"tandem-{server.proc.pid}-*"))
    finally:
        server.stop()

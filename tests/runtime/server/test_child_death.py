"""A dying scheduler takes the server down loudly: in-flight requests fail, the server exits non-zero."""
from __future__ import annotations

import os
import signal
import threading
import time

import orjson
import pytest
import requests

from server_utils import start_server

pytestmark = pytest.mark.timeout(180)


def test_killing_the_scheduler_fails_inflight_requests_and_exits_nonzero(tmp_path, tiny_model_dir):
    # every step slowed by 10 ms: the request is in flight for ~15 s, whatever the CPU's speed (the
    # tiny model alone finished its 1500 tokens inside the 1 s before the kill on oneDNN's fp32)
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000"],
                          str(tmp_path / "server.log"), env={"TANDEM_TEST_FORWARD_HANG": "0.01"})
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
        # the detokenizer must not outlive the server, nor the IPC directory
        assert _gone_within([pids["detokenizer_pid"]], 2.0)
        assert _ipc_dirs(server.proc.pid) == []
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


def _stream_events(server, body: dict, out: list) -> None:
    resp = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60)
    out.extend(line for line in resp.iter_lines() if line)


def test_sigterm_drains_then_exits_zero(tmp_path, tiny_model_dir):
    # every step sleeps 10 ms: the 1500-token requests outlast the 3 s grace period on any machine
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--graceful-shutdown-timeout", "3"], str(tmp_path / "server.log"),
                          env={"TANDEM_TEST_FORWARD_HANG": "0.01"})
    try:
        pids = server.info()
        long_sp = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
        short_events: list = []
        long_events: list = []
        results: dict = {}
        threads = [
            threading.Thread(target=_stream_events, args=(server, {"input_ids": [5] * 8, "sampling_params": {
                "max_new_tokens": 30, "temperature": 0, "ignore_eos": True}}, short_events)),
            threading.Thread(target=_stream_events, args=(server, {"input_ids": [6] * 8, "sampling_params": long_sp},
                                                         long_events)),
            threading.Thread(target=lambda: results.setdefault("long", server.generate(
                {"input_ids": [7] * 8, "sampling_params": long_sp}))),
        ]
        for t in threads:
            t.start()
        while server.info()["num_running_reqs"] < 3:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = server.post("/generate", {"input_ids": [8], "sampling_params": {"max_new_tokens": 1}})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert server.get("/health").status_code == 503
        for t in threads:
            t.join(30)
        assert server.proc.wait(30) == 0
        assert short_events[-1] == b"data: [DONE]"
        assert orjson.loads(short_events[-2][6:])["meta_info"]["finish_reason"]["type"] == "length"
        assert long_events[-1] == b"data: [DONE]"
        last = orjson.loads(long_events[-2][6:])["meta_info"]["finish_reason"]
        assert last["type"] == "abort" and "shutting down" in last["message"]
        reason = results["long"]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "shutting down" in reason["message"]
        assert 0 < len(results["long"]["output_ids"]) < 1500  # the partial output is kept
        for key in ("scheduler_pid", "detokenizer_pid"):
            assert not _alive(pids[key]), key
        assert _ipc_dirs(server.proc.pid) == []
    finally:
        server.stop()


def test_a_second_sigterm_exits_at_once(tmp_path, tiny_model_dir):
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--graceful-shutdown-timeout", "60"], str(tmp_path / "server.log"))
    try:
        pids = server.info()
        _busy(server)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None  # draining: the long request may take up to 60 s
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(10)  # the second signal exits at once (TimeoutExpired otherwise)
        assert _gone_within([pids["scheduler_pid"], pids["detokenizer_pid"]], 5.0)
    finally:
        server.stop()


def _ipc_dirs(main_pid: int) -> list[str]:
    import glob
    import tempfile

    return glob.glob(os.path.join(tempfile.gettempdir(), f"tandem-{main_pid}-*"))


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _busy(server) -> threading.Thread:
    """A long generation in the background, so the scheduler is busy when something dies."""
    def run() -> None:
        try:
            server.post("/generate", {"input_ids": [5] * 20, "sampling_params": {
                "max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}, timeout=60)
        except Exception:  # the connection drops with the server
            pass

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    deadline = time.monotonic() + 10
    while server.info()["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.info()["num_running_reqs"] > 0, "the long request never ran: the test would kill an idle server"
    return worker


def test_killing_the_main_process_leaves_no_orphans_and_no_ipc_dir(tmp_path, tiny_model_dir):
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000"],
                          str(tmp_path / "server.log"))
    try:
        pids = server.info()
        children = [pids["scheduler_pid"], pids["detokenizer_pid"]]
        assert _ipc_dirs(server.proc.pid)
        _busy(server)
        os.kill(server.proc.pid, signal.SIGKILL)
        assert _gone_within(children, 2.0), "a child outlived the main process by more than 2 s"
        assert _ipc_dirs(server.proc.pid) == []
    finally:
        server.stop()


def test_killing_the_detokenizer_takes_the_server_down(tmp_path, tiny_model_dir):
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000"],
                          str(tmp_path / "server.log"))
    try:
        pids = server.info()
        _busy(server)
        os.kill(pids["detokenizer_pid"], signal.SIGKILL)
        assert server.proc.wait(15) != 0
        assert _gone_within([pids["scheduler_pid"]], 2.0)
        assert _ipc_dirs(server.proc.pid) == []
    finally:
        server.stop()


def test_watchdog_takes_a_hung_scheduler_down_with_thread_stacks(tmp_path, tiny_model_dir):
    server = start_server(["--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000",
                           "--watchdog-timeout", "2"], str(tmp_path / "server.log"),
                          env={"TANDEM_TEST_FORWARD_HANG": "60"})
    try:
        resp = server.post("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert resp.status_code == 500 and "scheduler" in resp.json()["error"]["message"]
        assert server.proc.wait(15) != 0
        log = server.log()
        assert "watchdog: the scheduler made no progress" in log
        assert "tandem-forward" in log or "forward_worker.py" in log  # the hung thread's stack
    finally:
        server.stop()


def test_a_signal_during_the_startup_stops_it_at_once(tmp_path, tiny_model_dir):
    """SIGTERM while the children load (frozen here, as a slow load or a stuck TP rendezvous would
    hold them): the startup ends now, not once it completes; the children stop, the exit is 0,
    and no IPC directory is left."""
    import subprocess
    import sys

    from tandem.runtime.launcher import free_port

    cmd = [sys.executable, "-m", "tandem.launch.server", "--port", str(free_port()), "--log-level", "warning",
           "--model-path", tiny_model_dir("llama"), "--max-total-tokens", "4000", "--dtype", "float32"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(children) < 2 and time.monotonic() < deadline:
            children = _spawned_children(proc.pid)
            time.sleep(0.01)
        for pid in children:
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log_path.read_text()[-3000:]
        log_text = log_path.read_text()
        assert "SIGTERM during the startup: stopping" in log_text
        assert "startup failed" not in log_text and "Traceback" not in log_text, log_text[-3000:]
        assert len(children) == 2 and _gone_within(children, 5.0)
        assert _ipc_dirs(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _spawned_children(parent: int) -> list[int]:
    """The multiprocessing children of `parent` (not its resource tracker): spawned, or already
    titled tandem::<role>."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            spawned = b"spawn_main" in cmdline or cmdline.startswith(b"tandem::")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and spawned:
            found.append(int(entry))
    return found



def test_a_taken_grpc_port_ends_the_start_before_any_child_and_leaves_nothing(tmp_path, tiny_model_dir):
    import socket
    import subprocess
    import sys

    from tandem.runtime.launcher import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cmd = [sys.executable, "-m", "tandem.launch.server", "--port", str(free_port()), "--log-level", "warning",
               "--model-path", tiny_model_dir("llama"), "--dtype", "float32",
               "--grpc-port", str(taken.getsockname()[1])]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        try:
            log, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode != 0
    assert "is in use" in log and "--grpc-port" in log, log[-3000:]
    assert _ipc_dirs(proc.pid) == []  # the IPC directory made for the children is gone with them

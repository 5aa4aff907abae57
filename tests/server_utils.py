"""Start a real tandem server process on a free loopback port for end-to-end tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import requests

from tandem.runtime.launcher import free_port

STARTUP_TIMEOUT_S = 180
LEAK_MESSAGE = "KV memory leak detected"  # scheduler.py's idle check


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    url: str
    log_path: str

    def post(self, path: str, json=None, **kw) -> requests.Response:
        # control routes want a JSON content type even without a body
        return requests.post(self.url + path, json={} if json is None else json, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=kw.pop("timeout", 60), **kw)

    def generate(self, body: dict) -> dict:
        resp = self.post("/generate", body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def info(self) -> dict:
        return self.get("/get_server_info").json()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> int | None:
        """SIGTERM (a drain), a second SIGTERM if requests keep it busy, SIGKILL as the last resort;
        then fail if the scheduler's idle check found a leak (TANDEM_STRICT_MEM_CHECK): one after a
        server's last request stops a scheduler nobody asks any more, which only its log tells."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig) if sig == signal.SIGKILL else self.proc.send_signal(sig)
                self.proc.wait(wait)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        leaks = [line for line in self.log().splitlines() if LEAK_MESSAGE in line]
        assert not leaks, f"{self.log_path}: {leaks[0]}"
        return self.proc.returncode


def start_server(args: list[str], log_path: str, env: dict[str, str] | None = None) -> ServerHandle:
    port = free_port()
    if "--dtype" not in args:  # --dtype auto takes bf16 on AMX CPUs: tests compare against fp32 references
        args = [*args, "--dtype", "float32"]
    cmd = [sys.executable, "-m", "tandem.launch.server", "--port", str(port), "--log-level", "warning", *args]
    with open(log_path, "w") as log:  # the server writes through its own copy of the descriptor
        # cwd away from the repo root: its kernels/ folder would shadow the PyPI `kernels` that transformers probes
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True, cwd=os.path.dirname(os.path.abspath(log_path)))
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log_path)
    try:  # however the wait ends (a test's timeout, Ctrl-C), a server not handed out is stopped
        _wait_healthy(handle)
    except BaseException:
        handle.stop()
        raise
    return handle


def _wait_healthy(handle: ServerHandle) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if handle.proc.poll() is not None:
            raise RuntimeError(f"server exited with {handle.proc.returncode} during startup:\n{handle.log()[-3000:]}")
        try:
            if requests.get(handle.url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{handle.log()[-3000:]}")


def assert_no_leaks(server: ServerHandle) -> None:
    """After every request finished: flushing the cache frees every KV slot and request row."""
    deadline = time.monotonic() + 10
    while True:
        info = server.info()
        if info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    assert server.post("/flush_cache").status_code == 200
    info = server.info()
    assert info["kv_slots_free"] == info["max_total_num_tokens"], info
    assert info["req_rows_free"] == info["req_rows_total"], info

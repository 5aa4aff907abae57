"""A tandem server started by a benchmark: a child process on a free loopback port, always stopped.

Also what the soak and fuzz benches check after a run: the pids of the server's processes, their
memory, and whether anything (processes, IPC directories) outlived the server.
"""
from __future__ import annotations

import contextlib
import glob
import http.client
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

from tandem.runtime.launcher import free_port

STOP_GRACE_S = 10.0


class BenchError(RuntimeError):
    """A failure that ends a benchmark with a message instead of a traceback."""


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, http.client.HTTPException):  # not up yet, or up but half-started
        return False


def wait_for_health(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll GET /health until 200; fail at once if the server process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"server exited with code {proc.returncode} before it was healthy: "
                             f"{shlex.join(proc.args)}")
        if _healthy(base_url):
            return
        time.sleep(0.5)
    raise BenchError(f"server not healthy after {timeout_s:.0f} s: {shlex.join(proc.args)}")


def stop_server(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int | None:
    """SIGTERM (a drain), then SIGKILL after a grace period; then sweep its process group for
    strays. Returns the exit status the server gave itself (None if it had to be killed)."""
    status = None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            status = proc.wait(grace_s)
    else:
        status = proc.returncode
    # the server runs in its own session, so its pid is the group id of all its children
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return status


@contextlib.contextmanager
def start_server(server_args: str, module: str = "tandem.launch.server", timeout_s: float = 300.0,
                    env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start `python -m <module> --port P <server args>`; yield its base URL and process."""
    port = free_port()
    cmd = [sys.executable, "-m", module, "--port", str(port), *shlex.split(server_args)]
    print(f"Launching server: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_for_health(base_url, proc, timeout_s)
        yield base_url, proc
    finally:
        stop_server(proc)


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ipc_dirs(main_pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"tandem-{main_pid}-*"))


def _http_json(url: str, data: bytes | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body.startswith(b"{") else {}
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def leak_check(base_url: str) -> dict:
    """Wait until nothing runs or waits, flush the cache, then count what is free."""
    for _ in range(300):  # aborted and hung-up requests leave within a few steps
        _, info = _http_json(f"{base_url}/get_server_info")
        if info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0:
            break
        time.sleep(0.1)
    status, _ = _http_json(f"{base_url}/flush_cache", b"{}")
    _, info = _http_json(f"{base_url}/get_server_info")
    return {"flushed": status == 200, "kv_slots_free": info["kv_slots_free"],
            "kv_slots_total": info["max_total_num_tokens"], "req_rows_free": info["req_rows_free"],
            "req_rows_total": info["req_rows_total"], "num_retractions": info["num_retractions"],
            "ok": status == 200 and info["kv_slots_free"] == info["max_total_num_tokens"]
            and info["req_rows_free"] == info["req_rows_total"]}


def run_checked(run: Callable[[str], dict], print_report: Callable[[dict], None], problems_key: str,
                server_args: str, model_path: str | None, output_file: str | None) -> int:
    """A checking bench's main: run it against a launched server, print its report and checks;
    0 when every check passed, 1 on a check failure or a server that would not start."""
    try:
        result = run(server_args + (f" --model-path {model_path}" if model_path else ""))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_report(result)
    return report_checks(result, result[problems_key], output_file)


def report_checks(result: dict, problems: list[str], output_file: str | None) -> int:
    """Print each check and the problems found, write the JSON; 0 when every check passed."""
    print()
    for check, ok in result["checks"].items():
        print(f"[{'ok' if ok else 'FAIL'}] {check}")
    for problem in problems:
        print(f"  - {problem}")
    if output_file:
        with open(output_file, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["ok"] else 1

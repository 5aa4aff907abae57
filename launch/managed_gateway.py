"""The SGLang Model Gateway (`smg launch`, from PyPI) in front of tandem workers, always stopped.

Used by `bench serving --via-gateway` and the gateway tests. The gateway registers its workers
on its own schedule after it starts listening, so "ready" means a request went through it.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import requests

from tandem.launch.managed_server import BenchError
from tandem.runtime.launcher import free_port

PROBE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


class Gateway:
    """One `smg launch` process in its own session; `url` is its HTTP address."""

    def __init__(self, worker_urls: list[str], log_path: str = os.devnull, policy: str = "round_robin",
                 policy_args: tuple[str, ...] = ()) -> None:
        if shutil.which("smg") is None:
            raise BenchError("smg (the SGLang Model Gateway) is not installed: pip install smg")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        metrics_port = free_port()
        while metrics_port == self.port:  # neither is bound yet: the OS may hand out the same one twice (CI did)
            metrics_port = free_port()
        cmd = ["smg", "launch", "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *worker_urls,
               "--prometheus-port", str(metrics_port), "--shutdown-grace-period-secs", "1", "--policy", policy, *policy_args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, path: str = "/generate", body: dict | None = None, timeout_s: float = 120.0) -> None:
        """Until a request to `path` goes through the gateway with 200."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"smg exited with code {self.proc.returncode}")
            with contextlib.suppress(requests.RequestException):
                if requests.post(self.url + path, json=body or PROBE, timeout=60).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise BenchError(f"the gateway never served {path} within {timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextlib.contextmanager
def start_gateway(worker_urls: list[str], log_path: str = os.devnull) -> Iterator[str]:
    """A ready gateway in front of `worker_urls`; yields its URL."""
    gateway = Gateway(worker_urls, log_path)
    try:
        gateway.wait_ready()
        yield gateway.url
    finally:
        gateway.stop()

"""tandem workers behind the real SGLang Model Gateway (`smg launch`, from PyPI): two workers
over HTTP, and separately one over gRPC. 64 concurrent OpenAI chats through each gateway all
succeed, a client that disconnects through the gateway aborts the worker's request, and the
gateway's load view shows the workers' loads."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_utils import assert_no_leaks, free_port, start_server

pytestmark = pytest.mark.timeout(600)
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0}
LONG = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 1900, "temperature": 0,
        "ignore_eos": True, "stream": True}


class Gateway:
    def __init__(self, worker_urls: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["smg", "launch", "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *worker_urls,
             "--prometheus-port", str(free_port()), "--shutdown-grace-period-secs", "1", "--policy", "round_robin"],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 120) -> str:
        """Until a chat goes through (a gRPC worker's tokenizer registers after the worker)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, "smg exited"
            try:
                models = requests.get(self.url + "/v1/models", timeout=5).json()["data"]
                model = models[0]["id"]
                if requests.post(self.url + "/v1/chat/completions", json={**CHAT, "model": model},
                                 timeout=60).status_code == 200:
                    return model
            except (requests.RequestException, KeyError, IndexError, ValueError):
                pass
            assert time.monotonic() < deadline, "the gateway never served a chat"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_model_dir):
    assert shutil.which("smg"), "smg (the SGLang Model Gateway) is installed by the test extras"
    logs = tmp_path_factory.mktemp("gateway_logs")
    model, started = tiny_model_dir("llama"), []
    try:
        http_workers = [start_server(["--model-path", model, "--max-total-tokens", "6000"], str(logs / f"w{i}.log"))
                        for i in range(2)]
        started += http_workers
        grpc_port = free_port()
        grpc_worker = start_server(["--model-path", model, "--max-total-tokens", "6000", "--grpc-port", str(grpc_port)],
                                   str(logs / "wg.log"))
        started.append(grpc_worker)
        http_gw = Gateway([w.url for w in http_workers], str(logs / "smg_http.log"))
        started.append(http_gw)
        grpc_gw = Gateway([f"grpc://127.0.0.1:{grpc_port}"], str(logs / "smg_grpc.log"))
        started.append(grpc_gw)
        http_gw.model, grpc_gw.model = http_gw.wait_ready(), grpc_gw.wait_ready()
        yield {"http": (http_gw, http_workers), "grpc": (grpc_gw, [grpc_worker])}
    finally:
        for handle in reversed(started):
            handle.stop()


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_64_concurrent_chats_through_the_gateway(deployment, kind):
    gateway, workers = deployment[kind]

    def chat(i: int) -> dict:
        resp = requests.post(gateway.url + "/v1/chat/completions", timeout=300, json={
            **CHAT, "model": gateway.model, "messages": [{"role": "user", "content": f"Count to {i}."}]})
        assert resp.status_code == 200, resp.text
        return resp.json()

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(chat, range(64)))
    assert all(a["choices"][0]["finish_reason"] in ("stop", "length") and a["usage"]["completion_tokens"] > 0
               for a in answers)
    for w in workers:
        assert_no_leaks(w)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_disconnects_through_the_gateway_abort_and_loads_show_them(deployment, kind):
    """Eight long streams through the gateway, whose load view lists every worker's report; then
    the clients go away mid-stream and every worker aborts its requests."""
    gateway, workers = deployment[kind]
    streams = [requests.post(gateway.url + "/v1/chat/completions", json={**LONG, "model": gateway.model},
                             stream=True, timeout=120) for _ in range(8)]
    for resp in streams:
        lines = resp.iter_lines()
        while not next(lines).startswith(b"data: "):  # this request is running on a worker
            pass
    loads = requests.get(gateway.url + "/get_loads", timeout=30).json()["loads"]
    # a worker appears once the gateway has polled it (every 10 s): at least one, none unknown
    assert 1 <= len(loads) <= len(workers) and len({x["worker"] for x in loads}) == len(loads), json.dumps(loads)
    # the running count is not asserted: the gateway refreshes its view on its own cadence (seen
    # stale for the whole life of these streams); what it must show is every worker's own report
    assert all(x["max_total_num_tokens"] == 6000 and x["max_running_requests"] == 128 for x in loads), json.dumps(loads)
    assert sum(w.info()["num_running_reqs"] for w in workers) > 0  # still running when the clients leave
    for resp in streams:
        resp.close()
    for w in workers:
        assert_no_leaks(w)  # the gateway closed its worker connections, and the workers aborted

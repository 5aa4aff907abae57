"""`python -m tandem.launch.server`: the HTTP port is taken before the children start."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_a_taken_port_fails_the_start_before_any_child_runs(tiny_model_dir, tmp_path):
    """The port is bound first: a taken one ends the start with the bind error, before a model
    loads (uvicorn alone would bind after the startup, while TP ranks' sockets could take it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tandem.launch.server", "--port", str(port),
                               "--model-path", tiny_model_dir("llama"), "--dtype", "float32"],
                              capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 1
    assert f"port {port} is in use (--port {port}" in proc.stderr, proc.stderr[-2000:]
    # a start that got as far as the scheduler logs "model <path> loaded: ..."
    assert "loaded:" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert "Waiting for application startup" not in proc.stderr  # not even the tokenizer manager


def test_a_taken_grpc_port_fails_the_start_in_one_line_before_any_child_runs(tiny_model_dir, tmp_path):
    from tandem.runtime.launcher import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tandem.launch.server", "--port", str(free_port()),
                               "--grpc-port", str(port), "--model-path", tiny_model_dir("llama"),
                               "--dtype", "float32"], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 1
    assert f"port {port} is in use (--grpc-port {port}" in proc.stderr, proc.stderr[-2000:]
    assert "loaded:" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_second_server_on_the_port_of_one_still_starting_exits_at_once(tiny_model_dir, tmp_path):
    """The port listens from the first second of a start, so a second `tandem serve` on it, started
    while the first still loads, ends at once naming the port (both used to load their model and
    say "ready", and only one listened); the first then serves."""
    import time

    import requests

    from tandem.runtime.launcher import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "tandem.launch.server", "--port", str(port), "--model-path", tiny_model_dir("llama"),
           "--dtype", "float32", "--max-total-tokens", "2000", "--log-level", "info"]
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
        assert "tandem is ready" not in log.read_text()  # listening before the startup ended
        t0 = time.monotonic()
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert second.returncode == 1 and f"port {port} is in use" in second.stderr, second.stderr[-2000:]
        assert "loaded:" not in second.stdout + second.stderr
        assert time.monotonic() - t0 < 30  # no model load: the interpreter's start and the imports
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        out = requests.post(f"http://127.0.0.1:{port}/generate", timeout=60,
                            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 3
    finally:
        first.terminate()
        try:
            first.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, 9)
            first.wait(5)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("argv, toml, fragment", [
    (["--config", "{toml}"], '[server]\ndisable_radix_cache = "false"\n',
     "disable_radix_cache = 'false': expected bool, got str"),
    (["--config", "{toml}"], '[server]\nport = "30125"\n', "port = '30125': expected int, got str"),
    (["--config", "{toml}"], "[sever]\nport = 1\n", r"unknown table\(s\) \[sever\]"),
    (["--config", "/nonexistent.toml"], None, "--config '/nonexistent.toml': No such file"),
    (["--tokenizer-path", "/nonexistent"], None, "--tokenizer-path '/nonexistent' does not exist"),
    (["--max-prefill-tokens", "0"], None, "--max-prefill-tokens: invalid value 0"),
])
def test_bad_settings_exit_cleanly_naming_them(tiny_model_dir, tmp_path, capsys, monkeypatch, argv, toml, fragment):
    """As any bad flag value: argparse's usage, the setting and why, status 2; no traceback, no
    child started."""
    from tandem.launch import server

    monkeypatch.setattr(server, "run_server", lambda args, notes: pytest.fail(f"the server started with {args}"))
    if toml is not None:
        (tmp_path / "preset.toml").write_text(toml)
    argv = [a.replace("{toml}", str(tmp_path / "preset.toml")) for a in argv]
    with pytest.raises(SystemExit) as exited:
        server.main(["--model-path", tiny_model_dir("llama"), *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert re.search(fragment, err), err


def test_a_setting_only_the_scheduler_can_check_ends_the_start_in_one_line(tiny_model_dir, tmp_path):
    """--context-length beyond the model's is found once the scheduler reads the checkpoint: the
    start ends with the scheduler's reason in one line and status 1, no traceback from any process."""
    from tandem.runtime.launcher import free_port

    proc = subprocess.run([sys.executable, "-m", "tandem.launch.server", "--port", str(free_port()),
                           "--model-path", tiny_model_dir("llama"), "--dtype", "float32", "--context-length", "999999"],
                          capture_output=True, text=True, timeout=90, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert re.search(r"tandem serve: scheduler failed to start: ValueError: --context-length 999999 is more than "
                     r"the model's maximum \(\d+ positions\)", out), out[-3000:]
    assert "Traceback" not in out and "Application startup failed" not in out, out[-3000:]

"""`python -m tandem.launch.server`: the HTTP port is taken before the children start."""
from __future__ import annotations

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
    assert proc.returncode != 0
    assert "address already in use" in proc.stderr.lower(), proc.stderr[-2000:]
    # a start that got as far as the scheduler logs "model <path> loaded: ..."
    assert "loaded:" not in proc.stdout + proc.stderr, proc.stderr[-2000:]


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

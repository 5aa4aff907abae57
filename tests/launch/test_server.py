"""`python -m tandem.launch.server`: the HTTP port is taken before the children start."""
from __future__ import annotations

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

"""One log format across the processes: `[time LEVEL role] message` from the main process (uvicorn's
lines included), the scheduler and the detokenizer alike."""
from __future__ import annotations

import logging
import re

import pytest

from server_utils import start_server
from tandem.runtime.process import LOG_DATEFMT, log_format

LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) (main|scheduler|detokenizer)\] \S")


@pytest.mark.parametrize("role", ["main", "scheduler", "detokenizer"])
def test_the_format_names_time_level_and_process(role):
    record = logging.LogRecord("tandem.x", logging.WARNING, __file__, 1, "%d%% full", (90,), None)
    line = logging.Formatter(log_format(role), LOG_DATEFMT).format(record)
    assert LINE.match(line) and line.endswith(f"WARNING {role}] 90% full"), line


@pytest.mark.timeout(180)
def test_a_server_logs_one_format_in_every_process(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"  # the children write to the main process's stderr
    server = start_server(["--model-path", tiny_model_dir("llama"), "--log-level", "info"], str(log))
    try:
        server.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})  # a prefill line
    finally:
        server.stop()
    lines = [line for line in log.read_text().splitlines() if line.startswith("[")]
    roles = {m.group(2) for line in lines if (m := LINE.match(line))}
    assert {"main", "scheduler"} <= roles, lines
    assert all(LINE.match(line) for line in lines), [line for line in lines if not LINE.match(line)]
    # uvicorn's own lines come through the same format
    assert any(re.match(r"\[.* INFO main\] Application startup complete\.", line) for line in lines), lines

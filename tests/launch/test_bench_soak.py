"""The soak bench's short form: 60 s of mixed traffic with disconnects, aborts and forced
retraction; every request accounted for, no leaks, flat memory, nothing left behind."""
from __future__ import annotations

import orjson
import pytest

from tandem.launch.bench_soak import main

pytestmark = pytest.mark.timeout(400)


def test_soak_one_minute(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # away from the repo root: its kernels/ folder shadows the PyPI `kernels`
    out = tmp_path / "soak.json"
    status = main(["--minutes", "1", "--concurrency", "12", "--model-path", tiny_model_dir("llama"),
                   "--output-file", str(out)])
    result = orjson.loads(out.read_bytes())
    assert status == 0, result
    assert result["ok"] and all(result["checks"].values())
    outcomes = result["outcomes"]
    assert outcomes.get("finished", 0) > 0 and outcomes.get("aborted", 0) > 0 and outcomes.get("disconnected", 0) > 0
    assert result["requests"] == sum(outcomes.values()) and not result["problems"]
    assert result["leaks"]["num_retractions"] > 0

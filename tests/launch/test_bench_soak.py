"""The soak bench's short form: 60 s of mixed traffic with disconnects, aborts and forced
retraction; every request accounted for, no leaks, flat memory, nothing left behind."""
from __future__ import annotations

import orjson
import pytest

from tandem.launch.bench_soak import _drift, main

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


def test_drift_skips_warm_up_and_catches_steady_growth():
    warm_then_flat = [500, 600, 650, 690, 694, 698, 697, 693]
    assert _drift(warm_then_flat) == pytest.approx(695 / 670)
    leaking = [500 + 40 * i for i in range(8)]  # 2 MB/s for the whole run
    assert _drift(leaking) == pytest.approx(760 / 600)
    assert _drift(leaking) > 1.25
    assert _drift([1, 2, 3]) == 1.0  # too few samples to judge

"""The soak bench's short form: 60 s of mixed traffic with disconnects, aborts and forced
retraction; every request accounted for, no leaks, flat memory, nothing left behind."""
from __future__ import annotations

import orjson
import pytest

from tandem.launch.bench_soak import _drift, _quarters, main

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


def test_the_printed_drift_and_the_json_quarters_use_the_same_windows():
    """9 samples: the quarters are [0:2], [2:4], [4:6], [6:8]; the drift took [-2:] = [7:9] as
    its last quarter, so the printed drift disagreed with the JSON's quarters."""
    samples = [100 * 2**20] * 8 + [900 * 2**20]  # a spike in the one sample no quarter holds
    assert _quarters(samples) == [100.0] * 4
    assert _drift(samples) == pytest.approx(1.0)
    rising = [(100 + 10 * i) * 2**20 for i in range(11)]
    quarters = _quarters(rising)
    assert _drift(rising) == pytest.approx(quarters[3] / quarters[1])

"""The soak bench's short form: 60 s of mixed traffic with disconnects, aborts and forced
retraction; every request accounted for, no leaks, flat memory, nothing left behind."""
from __future__ import annotations

import orjson
import pytest

from tandem.launch.bench_soak import RssSamples, Tally, _drift, _quarters, main, plot_soak

pytestmark = pytest.mark.timeout(400)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_soak_one_minute(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # away from the repo root: its kernels/ folder shadows the PyPI `kernels`
    out, plot = tmp_path / "soak.json", tmp_path / "soak.png"
    status = main(["--minutes", "1", "--concurrency", "12", "--model-path", tiny_model_dir("llama"),
                   "--output-file", str(out), "--plot", str(plot)])
    result = orjson.loads(out.read_bytes())
    assert status == 0, result
    assert result["plot"] == str(plot) and _png_size(plot) == (1100, 800)  # RSS and latency over the run
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


def test_the_plot_draws_rss_and_latency_over_time(tmp_path):
    """The figure alone, from made-up samples: a process missing samples and no answers at all
    both still draw."""
    tally = Tally(seconds=[0.2, 0.4, 3.0, 0.3], answered_at=[101.0, 102.5, 130.0, 150.0])
    rss = RssSamples(100.0, {"main": [300 * 2**20, 310 * 2**20, 305 * 2**20], "scheduler": [700 * 2**20]},
                     {"main": [0.0, 2.0, 4.0], "scheduler": [0.0]})
    for name, t in (("soak.png", tally), ("none.png", Tally())):
        plot_soak(str(tmp_path / name), t, rss)
        assert _png_size(tmp_path / name) == (1100, 800)

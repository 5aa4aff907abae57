"""`tandem bench serving --launch` against a real tandem server on the tiny model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tandem.launch import bench_serving, managed_server

RESULT_KEYS = (
    "backend", "dataset_name", "request_rate", "num_prompts", "duration", "duration_s", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "total_cached_tokens", "cache_hit_rate", "request_throughput",
    "input_throughput", "output_throughput", "total_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_itl_ms", "mean_tpot_ms", "mean_e2e_latency_ms", "errors",
)


@pytest.fixture
def started(tmp_path: Path, monkeypatch):
    """Every process the bench starts, to check it stopped them; killed afterwards if not."""
    # away from the repo root: its kernels/ folder would shadow the PyPI package transformers probes
    monkeypatch.chdir(tmp_path)
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(managed_server.subprocess, "Popen", recording_popen)
    yield started
    for proc in started:  # belt and braces: never leave a process behind a failed assertion
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.timeout(300)
def test_launch_runs_against_a_real_server(tiny_model_dir, tmp_path: Path, started) -> None:
    out = tmp_path / "serving.json"
    server_args = f"--model-path {tiny_model_dir('llama')} --max-total-tokens 4000 --log-level warning"
    rc = bench_serving.main(["--launch", "--server-args", server_args, "--num-prompts", "8",
                             "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1.0",
                             "--disable-tqdm",
                             "--output-file", str(out)])
    assert len(started) == 1
    assert started[0].poll() is not None, "bench_serving left its server running"
    assert rc == 0
    r = json.loads(out.read_text())
    missing = [k for k in RESULT_KEYS if k not in r]
    assert not missing, missing
    assert r["completed"] == 8 and r["failed"] == 0 and r["errors"] == []
    assert r["total_input_tokens"] == 8 * 16 and r["total_output_tokens"] == 8 * 8  # exact lengths, ignore_eos
    for key in ("duration_s", "request_throughput", "output_throughput", "mean_ttft_ms", "mean_e2e_latency_ms"):
        assert r[key] > 0, key
    assert r["mean_ttft_ms"] <= r["mean_e2e_latency_ms"]


@pytest.mark.timeout(300)
def test_via_gateway_runs_the_workload_both_ways(tiny_model_dir, tmp_path: Path, started) -> None:
    """--via-gateway: smg in front of the launched server; the same rows straight and through it;
    the server and the gateway are both stopped afterwards."""
    out = tmp_path / "gateway.json"
    server_args = f"--model-path {tiny_model_dir('llama')} --max-total-tokens 4000 --log-level warning"
    rc = bench_serving.main(["--launch", "--server-args", server_args, "--num-prompts", "6",
                             "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1.0",
                             "--via-gateway", "--gateway-rounds", "1", "--disable-tqdm", "--output-file", str(out)])
    assert [p.args[0] for p in started][1:] == ["smg"]
    assert all(p.poll() is not None for p in started), "a server or the gateway was left running"
    assert rc == 0
    r = json.loads(out.read_text())
    for path in ("direct", "gateway"):
        assert r[path]["completed"] == 6 and r[path]["failed"] == 0, r[path]
        assert r["rounds"][path][0]["total_output_tokens"] == 6 * 8
    assert r["gateway_over_direct"] == pytest.approx(r["gateway"]["output_throughput"] / r["direct"]["output_throughput"])


@pytest.mark.timeout(300)
def test_compare_overlap_runs_two_servers_in_alternating_rounds(tiny_model_dir, tmp_path: Path, started) -> None:
    """--compare-overlap: one server with the overlap schedule, one without, from the same
    --server-args; rounds alternate which goes first; both servers stopped afterwards."""
    out = tmp_path / "overlap.json"
    server_args = f"--model-path {tiny_model_dir('llama')} --max-total-tokens 4000 --log-level warning"
    rc = bench_serving.main(["--launch", "--server-args", server_args, "--num-prompts", "6",
                             "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "1.0",
                             "--compare-overlap", "--overlap-rounds", "2", "--disable-tqdm",
                             "--output-file", str(out)])
    assert len(started) == 2 and all(p.poll() is not None for p in started), "a server was left running"
    assert ["--disable-overlap-schedule" in p.args for p in started] == [True, False]
    assert rc == 0
    r = json.loads(out.read_text())
    for side in ("overlap off", "overlap on"):
        assert r[side]["completed"] == 2 * 6 and r[side]["failed"] == 0, r[side]
        assert [run["total_output_tokens"] for run in r["rounds"][side]] == [6 * 8, 6 * 8]
    assert r["overlap_on_over_off"] == pytest.approx(r["overlap on"]["output_throughput"]
                                                     / r["overlap off"]["output_throughput"])
    assert len(r["round_ratios"]) == 2

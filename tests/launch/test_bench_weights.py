"""`tandem bench weights` runs on a tiny model and reports every part of an update."""
from __future__ import annotations

import json

import pytest

from tandem.launch import bench_weights

pytestmark = pytest.mark.timeout(300)


def test_bench_weights_reports_each_part(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_weights, "memory_bandwidth", lambda: 1e10)  # the real one copies 1 GB
    out = tmp_path / "w.json"
    assert bench_weights.main(["--model-path", tiny_model_dir("qwen2"), "--repeats", "1", "--output-file", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("read_from_disk_s", "transfer_gloo_s", "transfer_gloo_flat_s", "check_s", "copy_and_repack_s",
                "engine_update_from_disk_s", "engine_update_from_distributed_s",
                "engine_update_from_distributed_flat_s", "target_s", "tcp_loopback_s"):
        assert result[key] > 0, key
    assert result["target_over_tcp_s"] == result["target_s"] + result["tcp_loopback_s"]
    assert result["bytes"] > 0 and "copy + repack" in capsys.readouterr().out

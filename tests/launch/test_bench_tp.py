"""`tandem bench tp` on the tiny model: both TP sizes serve the whole workload, and only TP=2
reports time in collectives."""
from __future__ import annotations

import json

import pytest

from tandem.launch import bench_tp


@pytest.mark.timeout(300)
def test_bench_tp_reports_each_size(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert bench_tp.main(["--model-path", tiny_model_dir("llama"), "--tp-sizes", "1", "2", "--num-seqs", "4",
                          "--output-len", "6", "--max-total-tokens", "3000", "--output-file", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tp_size"] for r in rows] == [1, 2]
    assert all(r["output_tokens"] == 24 and r["steps"] > 0 for r in rows)
    assert rows[0]["comm_ms_per_step"] == 0 and rows[1]["comm_ms_per_step"] > 0
    assert "comm ms/step" in capsys.readouterr().out

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


@pytest.mark.timeout(120)
def test_a_size_that_does_not_split_the_model_is_refused_before_any_run(tiny_model_dir, capsys):
    # the tiny model has 4 query / 2 KV heads: 3 splits neither, and TP=1 must not run first only to be lost
    with pytest.raises(SystemExit) as exit_info:
        bench_tp.main(["--model-path", tiny_model_dir("llama"), "--tp-sizes", "1", "3", "--num-seqs", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr()
    assert "--tp-sizes 3: --tp-size 3 does not divide the model's query heads and KV heads" in err.err
    assert "tok/s" not in err.out

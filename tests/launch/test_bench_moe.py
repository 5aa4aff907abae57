"""`tandem bench moe` and `tandem bench one-batch --transformers` run end to end at toy sizes (the
figures themselves are for a quiet machine, never asserted)."""
from __future__ import annotations

import json

import pytest

from tandem.launch import bench_moe, bench_one_batch

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bench_moe_reports_fused_and_loop_decode(tmp_path, capsys, arch):
    out = tmp_path / "moe.json"
    assert bench_moe.main(["--arch", arch, "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                           "--experts", "8", "--top-k", "2", "--expert-width", "32", "--batch-size", "1", "4",
                           "--input-len", "8", "--output-len", "4", "--repeats", "1", "--output-file", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert all(r["fused_decode_tok_s"] > 0 and r["loop_decode_tok_s"] > 0 and r["layer_fused_s"] > 0 for r in rows)
    assert "fused/loop" in capsys.readouterr().out


def test_one_batch_beside_transformers(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "one_batch.jsonl"
    assert bench_one_batch.main(["--model-path", tiny_model_dir("gemma3"), "--batch-size", "2", "--input-len", "20",
                                 "--output-len", "4", "--dtype", "float32", "--transformers",
                                 "--output-file", str(out)]) == 0
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["transformers"]["decode_throughput_tok_s"] > 0 and row["decode_over_transformers"] > 0
    assert "tandem / transformers at batch 2" in capsys.readouterr().out

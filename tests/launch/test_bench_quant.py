"""`tandem bench one-batch --quantization ...` (launch/bench_quant.py): every weight format of the
GGUF model in one call, one table, and the batch-1 bandwidth bound."""
from __future__ import annotations

import json

import pytest

from tandem.launch import bench_one_batch, bench_quant
from tandem.runtime.model_files import default_model_path


def test_variants_resolve_to_a_file_and_a_quantization(tiny_model_dir):
    shipped = default_model_path()
    assert bench_quant.resolve(None, "none") == (None, "none")
    assert bench_quant.resolve(None, "gguf") == (None, "gguf")
    path, quantization = bench_quant.resolve(None, "q8_0")
    assert quantization == "gguf" and path != shipped and path.endswith("-q8_0.gguf")
    with pytest.raises(ValueError, match="not one"):
        bench_quant.resolve(tiny_model_dir("llama"), "q8_0")
    with pytest.raises(ValueError, match="one of"):
        bench_quant.resolve(None, "fp8")


@pytest.mark.timeout(900)
def test_one_call_runs_each_format_and_prints_the_bound(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert bench_one_batch.main(["--quantization", "gguf", "q8_0", "--batch-size", "1", "2", "--input-len", "8",
                                 "--output-len", "3", "--dtype", "float32", "--output-file", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["variant"], r["batch_size"]) for r in rows] == [("gguf", 1), ("gguf", 2), ("q8_0", 1), ("q8_0", 2)]
    assert [r["weights"] for r in rows] == ["gguf:q4_1+q8_0"] * 2 + ["gguf:q8_0"] * 2
    first = rows[0]
    assert 90e6 < first["decode_bytes_per_token"] <= first["weight_bytes"]  # every linear and the head, once
    assert first["bandwidth_bound_tok_s"] > 0 and first["stream_gb_s_1gib"] > 0
    text = capsys.readouterr().out
    assert "B/token MB" in text and "gguf gguf:q4_1+q8_0" in text and "q8_0 gguf:q8_0" in text

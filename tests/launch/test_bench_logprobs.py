"""`tandem bench logprobs` runs offline and writes every result key."""
from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tandem.launch.bench_logprobs import FORMATS, main, run_local


def test_main_writes_all_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["--positions", "512", "--k", "2", "--repeats", "2", "--output-file", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    for key in ("nested_ms", "flat_ms", "b64_ms", "nested_bytes", "flat_bytes", "b64_bytes",
                "flat_speedup_over_nested", "b64_speedup_over_nested",
                "flat_size_ratio", "b64_size_ratio"):
        assert result[key] > 0, key
    assert result["positions"] == 512 and result["k"] == 2
    # Sizes are deterministic (unlike times): flat+b64 is the smallest, nested the largest.
    assert result["b64_bytes"] < result["flat_bytes"] < result["nested_bytes"]
    table = capsys.readouterr().out
    assert all(fmt in table for fmt in FORMATS)


def test_run_local_returns_dict_without_printing(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_local(positions=64, k=3, repeats=1)
    assert result["k"] == 3 and "flat_np_speedup_over_nested" in result
    assert capsys.readouterr().out == ""

"""`tandem bench prefix` on the tiny model: cache on hits, cache off does not, every key written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.launch.bench_prefix import main, make_groups


def test_groups_share_their_prefix_only() -> None:
    groups = make_groups(2, 3, 10, 4, vocab=1000, seed=1)
    assert groups == make_groups(2, 3, 10, 4, vocab=1000, seed=1)
    assert [len(g) for g in groups] == [3, 3] and all(len(p) == 14 for g in groups for p in g)
    assert len({tuple(p[:10]) for p in groups[0]}) == 1
    assert groups[0][0][:10] != groups[1][0][:10]
    assert len({tuple(p[10:]) for g in groups for p in g}) == 6


@pytest.mark.timeout(300)
def test_main_cache_on_hits_and_off_does_not(tiny_model_dir, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prefix.json"
    argv = ["--model-path", tiny_model_dir("llama"), "--num-groups", "2", "--prompts-per-group", "3",
            "--prefix-len", "64", "--question-len", "8", "--output-len", "4", "--output-file", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["cache_hit_rate_cache_off"] == 0.0
    # at most the non-first prompts of each group can reuse the prefix
    assert 0.0 < r["cache_hit_rate_cache_on"] <= (2 / 3) * 64 / 72 + 1e-3  # JSON rounds to 4 places
    for mode in ("cache_on", "cache_off"):
        assert r[f"completed_{mode}"] == 6
        for key in ("ttft_mean_ms", "ttft_median_ms", "throughput_tok_s", "output_tok_s", "duration_s"):
            assert r[f"{key}_{mode}"] > 0, (key, mode)
        # throughput covers prompt + output tokens of every request
        assert r[f"throughput_tok_s_{mode}"] == pytest.approx(6 * (72 + 4) / r[f"duration_s_{mode}"], rel=1e-2)
    assert r["ttft_speedup"] == pytest.approx(r["ttft_mean_ms_cache_off"] / r["ttft_mean_ms_cache_on"], rel=1e-2)
    assert r["throughput_ratio"] == pytest.approx(r["throughput_tok_s_cache_on"] / r["throughput_tok_s_cache_off"],
                                                  rel=1e-2)
    assert r["ttft_median_speedup"] > 0 and r["num_groups"] == 2 and r["cpu_cores"] >= 1
    table = capsys.readouterr().out
    assert "radix cache on" in table and "TTFT speedup" in table

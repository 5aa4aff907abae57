"""Paired comparisons of bench serving (launch/bench_serving_ab.py), without servers: the round
order and the pooled and per-round ratios."""
from __future__ import annotations

import pytest

from tandem.launch import bench_serving_ab


def test_rounds_take_turns_at_going_first() -> None:
    sides = ["off", "on"]
    assert [bench_serving_ab.side_order(sides, i) for i in range(3)] == [["off", "on"], ["on", "off"], ["off", "on"]]
    assert sides == ["off", "on"]  # the caller's list is left as it was


def _run(tokens: int, seconds: float, ttft: float = 10.0) -> dict:
    return {"duration_s": seconds, "completed": 4, "failed": 0, "total_output_tokens": tokens,
            "mean_ttft_ms": ttft, "mean_itl_ms": 1.0}


def test_summary_pools_rounds_and_keeps_each_rounds_ratio(capsys) -> None:
    runs = {"off": [_run(100, 1.0), _run(100, 2.0)], "on": [_run(100, 0.5), _run(100, 2.5)]}
    s = bench_serving_ab.summarize(runs, "on / off")
    assert s["off"]["output_throughput"] == pytest.approx(200 / 3.0)
    assert s["on"]["output_throughput"] == pytest.approx(200 / 3.0)
    assert s["ratio"] == pytest.approx(1.0)  # pooled: the same tokens in the same total time
    assert s["round_ratios"] == pytest.approx([2.0, 0.8]) and s["round_ratio_median"] == pytest.approx(1.4)
    assert s["off"]["completed"] == 8 and s["rounds"] is runs
    assert "on / off output throughput: 1.000x pooled; rounds 2.000, 0.800 (median 1.400x)" in capsys.readouterr().out

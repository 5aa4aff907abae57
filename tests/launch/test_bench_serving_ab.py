"""Paired comparisons of bench serving (launch/bench_serving_ab.py), without servers: the round
order, the pooled and per-round ratios, a side that produced nothing, and the CLI's checks of
which comparison options go together."""
from __future__ import annotations

import re

import pytest

from tandem.launch import bench_serving_ab
from tandem.launch.managed_server import BenchError


def test_rounds_take_turns_at_going_first() -> None:
    sides = ["off", "on"]
    assert [bench_serving_ab.side_order(sides, i) for i in range(3)] == [["off", "on"], ["on", "off"], ["off", "on"]]
    assert sides == ["off", "on"]  # the caller's list is left as it was
    calls: list[str] = []
    runs = bench_serving_ab.run_rounds({side: (lambda side=side: calls.append(side) or {"n": len(calls)})
                                        for side in sides}, rounds=3)
    assert calls == ["off", "on", "on", "off", "off", "on"]
    assert runs == {"off": [{"n": 1}, {"n": 4}, {"n": 5}], "on": [{"n": 2}, {"n": 3}, {"n": 6}]}


def _run(tokens: int, seconds: float, ttft: float = 10.0) -> dict:
    return {"duration_s": seconds, "completed": 4, "failed": 0, "total_output_tokens": tokens,
            "output_throughput": tokens / seconds, "mean_ttft_ms": ttft, "mean_itl_ms": 1.0}


def test_summary_pools_rounds_and_keeps_each_rounds_ratio(capsys) -> None:
    runs = {"off": [_run(100, 1.0), _run(100, 2.0)], "on": [_run(100, 0.5), _run(100, 2.5)]}
    s = bench_serving_ab.summarize(runs, "on / off")
    assert s["off"]["output_throughput"] == pytest.approx(200 / 3.0)
    assert s["on"]["output_throughput"] == pytest.approx(200 / 3.0)
    assert s["ratio"] == pytest.approx(1.0)  # pooled: the same tokens in the same total time
    assert s["round_ratios"] == pytest.approx([2.0, 0.8]) and s["round_ratio_median"] == pytest.approx(1.4)
    assert s["off"]["completed"] == 8 and s["rounds"] is runs
    assert "on / off output throughput: 1.000x pooled; rounds 2.000, 0.800 (median 1.400x)" in capsys.readouterr().out


def test_a_side_without_output_is_a_bench_error_not_a_division_by_zero() -> None:
    runs = {"off": [_run(100, 1.0)], "on": [{**_run(1, 1.0), "total_output_tokens": 0, "output_throughput": 0.0}]}
    with pytest.raises(BenchError, match="on produced no output"):
        bench_serving_ab.summarize(runs, "on / off")


def test_overlap_servers_must_have_one_pool_size(monkeypatch) -> None:
    """A pool sized from free memory comes out smaller for the second server: refused, not compared."""
    import argparse
    import contextlib

    started: list[str] = []

    @contextlib.contextmanager
    def fake_server(server_args, module, timeout):
        started.append(server_args)
        yield f"http://s{len(started)}", None

    pools = {"http://s1": 1000, "http://s2": 900}
    overlap = {"http://s1": False, "http://s2": True}
    monkeypatch.setattr(bench_serving_ab, "start_server", fake_server)
    monkeypatch.setattr(bench_serving_ab, "_server_info",
                        lambda url: {"max_total_num_tokens": pools[url], "overlap_schedule": overlap[url]})
    args = argparse.Namespace(server_args="--dtype float32", server_module="m", launch_timeout=1.0)
    with pytest.raises(BenchError, match="--max-total-tokens"):
        with bench_serving_ab.overlap_servers(args):
            pass
    assert started == ["--dtype float32 --disable-overlap-schedule", "--dtype float32"]
    pools.update({"http://s3": 1000, "http://s4": 1000})  # --max-total-tokens given: one size
    overlap.update({"http://s3": False, "http://s4": True})
    with bench_serving_ab.overlap_servers(args) as urls:
        assert urls == {"overlap off": "http://s3", "overlap on": "http://s4"}
    pools.update({"http://s5": 1000, "http://s6": 1000})
    overlap.update({"http://s5": False, "http://s6": False})  # a server that ran other than asked
    with pytest.raises(BenchError, match="not off and on"):
        with bench_serving_ab.overlap_servers(args):
            pass


@pytest.mark.parametrize("argv, message", [
    (["--compare-overlap"], "--compare-overlap needs --launch"),
    (["--launch", "--compare-overlap", "--via-gateway"], "--via-gateway and --compare-overlap: one comparison a run"),
    (["--via-gateway", "--json-schema", "s.json"], "one comparison a run"),
    (["--launch", "--compare-overlap", "--server-args", "--disable-overlap-schedule"], "leave it out"),
    (["--overlap-rounds", "3"], "--overlap-rounds must be >= 1 and needs --compare-overlap"),
    (["--via-gateway", "--gateway-rounds", "0"], "--gateway-rounds must be >= 1 and needs --via-gateway"),
    (["--launch", "--compare-overlap", "--plot", "x.png"], "--plot draws one run"),
])
def test_comparison_options_are_checked(argv, message, tmp_path, monkeypatch) -> None:
    from tandem.launch import bench_serving

    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.json").write_text("{}")
    with pytest.raises(SystemExit, match=re.escape(message)):
        bench_serving.parse_args(argv)
    args = bench_serving.parse_args(["--launch", "--compare-overlap"])
    assert (args.overlap_rounds, args.gateway_rounds) == (4, 2)

"""Paired comparisons for `tandem bench serving`: the same rows through two setups in alternating
rounds, each server's cache flushed before each round, so the drift of a shared machine hits both
sides alike.

- `--via-gateway`: straight to the server, and through the SGLang Model Gateway (smg) in front of it.
- `--compare-overlap` (with `--launch`): two servers from the same `--server-args`, one with the
  overlap schedule (the default) and one with `--disable-overlap-schedule`.

bench_serving hands each comparison a `MeasureAt` (its own client, one round against one URL);
this module starts what is compared, runs the rounds, checks which options go together, and
reports.

Rounds take turns at which side goes first (A B, B A, A B, ...): a machine that slows or speeds up
over the bench then favours neither side. Each round's pair also gives its own ratio, and their
median is printed beside the pooled ratio: on two shared cores single runs vary by 5-10%.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tandem.launch.managed_server import BenchError, start_server


def side_order(sides: list[str], round_no: int) -> list[str]:
    """The order the two sides run in round `round_no`: as given in even rounds, swapped in odd ones."""
    return sides if round_no % 2 == 0 else sides[::-1]


Measure = Callable[[], dict[str, Any]]  # one round of one side: flush the cache, send every row, report
# (URL to send the rows to, server whose cache to flush first) -> that round's measurement
MeasureAt = Callable[[str, str], Measure]


def check_comparison(args: argparse.Namespace) -> None:
    """At most one comparison a run (--json-schema, --via-gateway, --compare-overlap), with the
    options it reads and none it would drop; fills in the default round counts."""
    modes = [flag for flag, on in (("--json-schema", args.json_schema), ("--via-gateway", args.via_gateway),
                                   ("--compare-overlap", args.compare_overlap)) if on]
    if len(modes) > 1:
        raise SystemExit(f"{' and '.join(modes)}: one comparison a run")
    for flag, rounds, mode_flag, mode in (("--gateway-rounds", args.gateway_rounds, "--via-gateway", args.via_gateway),
                                          ("--overlap-rounds", args.overlap_rounds, "--compare-overlap",
                                           args.compare_overlap)):
        if rounds is not None and (not mode or rounds < 1):
            raise SystemExit(f"{flag} must be >= 1 and needs {mode_flag}")
    args.gateway_rounds, args.overlap_rounds = args.gateway_rounds or 2, args.overlap_rounds or 4
    if args.plot and (args.via_gateway or args.compare_overlap):
        raise SystemExit("--plot draws one run: not with --via-gateway or --compare-overlap")
    if args.compare_overlap and not args.launch:
        raise SystemExit("--compare-overlap needs --launch: it starts the two servers itself")
    if args.compare_overlap and "--disable-overlap-schedule" in args.server_args:
        raise SystemExit("--compare-overlap starts the server with and without --disable-overlap-schedule: "
                         "leave it out of --server-args")


def compare_via_gateway(args: argparse.Namespace, base_url: str, measure_at: MeasureAt) -> dict[str, Any]:
    """--via-gateway: the same rows straight to the server and through smg in front of it."""
    from tandem.launch.managed_gateway import start_gateway

    with start_gateway([base_url]) as gateway_url:
        runs = run_rounds({"direct": measure_at(base_url, base_url),
                           "gateway": measure_at(gateway_url, base_url)}, args.gateway_rounds)
    combined = summarize(runs, "gateway / direct")
    combined["gateway_over_direct"] = combined.pop("ratio")
    return write_comparison(args, combined, "gateway")


def compare_overlap(args: argparse.Namespace, measure_at: MeasureAt) -> dict[str, Any]:
    """--compare-overlap: the same rows through a server with the overlap schedule and one without."""
    with overlap_servers(args) as urls:
        runs = run_rounds({side: measure_at(url, url) for side, url in urls.items()}, args.overlap_rounds)
    combined = summarize(runs, "overlap on / off")
    combined["overlap_on_over_off"] = combined.pop("ratio")
    return write_comparison(args, combined, "overlap on")


def run_rounds(sides: dict[str, Measure], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Each side's measurement `rounds` times, alternating; each side's reports in order."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for round_no in range(rounds):
        for side in side_order(list(sides), round_no):
            print(f"\n== round {round_no + 1}: {side}", flush=True)
            runs[side].append(sides[side]())
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]], label: str) -> dict[str, Any]:
    """Pool each side's rounds, print the table and `label` (second side / first side), return both."""
    first, second = list(runs)
    for side, rs in runs.items():
        if not all(r["total_output_tokens"] for r in rs):
            raise BenchError(f"a round of {side} produced no output tokens: see its errors above")
    summary = {side: pooled(rs) for side, rs in runs.items()}
    ratio = summary[second]["output_throughput"] / summary[first]["output_throughput"]
    pairs = [b["output_throughput"] / a["output_throughput"] for a, b in zip(runs[first], runs[second])]
    width = max(10, *(len(side) + 2 for side in runs))
    print(f"\n{'side':<{width}}{'out tok/s':>12}{'req/s':>10}{'mean TTFT ms':>15}{'mean ITL ms':>14}{'failed':>8}")
    for side, m in summary.items():
        print(f"{side:<{width}}{m['output_throughput']:>12.1f}{m['request_throughput']:>10.2f}"
              f"{m['mean_ttft_ms']:>15.1f}{m['mean_itl_ms']:>14.2f}{m['failed']:>8}")
    print(f"{label} output throughput: {ratio:.3f}x pooled; rounds {', '.join(f'{r:.3f}' for r in pairs)} "
          f"(median {statistics.median(pairs):.3f}x)", flush=True)
    return {**summary, "ratio": ratio, "round_ratios": pairs, "round_ratio_median": statistics.median(pairs),
            "rounds": runs}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one side as one: throughputs over the summed durations, latencies averaged."""
    duration = sum(r["duration_s"] for r in runs)
    return {"duration_s": duration, "completed": sum(r["completed"] for r in runs),
            "failed": sum(r["failed"] for r in runs),
            "output_throughput": sum(r["total_output_tokens"] for r in runs) / duration,
            "request_throughput": sum(r["completed"] for r in runs) / duration,
            "mean_ttft_ms": float(np.mean([r["mean_ttft_ms"] for r in runs])),
            "mean_itl_ms": float(np.mean([r["mean_itl_ms"] for r in runs]))}


@contextlib.contextmanager
def overlap_servers(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Two servers from --server-args, overlap schedule off and on, with KV pools of one size;
    both stopped afterwards. Only one serves at a time: the other's scheduler sleeps in its
    receive poll."""
    off_args = f"{args.server_args} --disable-overlap-schedule"
    with start_server(off_args, args.server_module, args.launch_timeout) as (off_url, _), \
            start_server(args.server_args, args.server_module, args.launch_timeout) as (on_url, _):
        urls = {"overlap off": off_url, "overlap on": on_url}
        infos = {side: _server_info(url) for side, url in urls.items()}
        pools = {side: info["max_total_num_tokens"] for side, info in infos.items()}
        if len(set(pools.values())) > 1:  # sized from free memory, which the first server took
            raise BenchError(f"the two servers' KV pools differ ({pools}): give --max-total-tokens in --server-args")
        ran = {side: info.get("overlap_schedule") for side, info in infos.items()}
        if ran != {"overlap off": False, "overlap on": True}:
            raise BenchError(f"the servers' overlap schedules are not off and on: {ran}")
        yield urls


def write_comparison(args: argparse.Namespace, combined: dict[str, Any], main_side: str) -> dict[str, Any]:
    """The comparison as --output-file; returns the main side's pooled result for main's exit status."""
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(combined, f, indent=2)
    sides = [combined[side] for side in combined["rounds"]]
    return {**combined[main_side], "completed": min(m["completed"] for m in sides)}


def flush_cache(base_url: str) -> None:
    import requests

    requests.post(base_url + "/flush_cache", json={}, timeout=60).raise_for_status()


def _server_info(base_url: str) -> dict[str, Any]:
    import requests

    resp = requests.get(base_url + "/server_info", timeout=30)
    resp.raise_for_status()
    return resp.json()

"""Paired comparisons for `tandem bench serving`: the same rows through two setups in alternating
rounds, each server's cache flushed before each round, so the drift of a shared machine hits both
sides alike.

- `--via-gateway`: straight to the server, and through the SGLang Model Gateway (smg) in front of it.
- `--compare-overlap` (with `--launch`): two servers from the same `--server-args`, one with the
  overlap schedule (the default) and one with `--disable-overlap-schedule`.

Rounds take turns at which side goes first (A B, B A, A B, ...): a machine that slows or speeds up
over the bench then favours neither side. Each round's pair also gives its own ratio, and their
median is printed beside the pooled ratio: on two shared cores single runs vary by 5-10%.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import statistics
from collections.abc import Iterator
from typing import Any

import numpy as np

from tandem.launch.bench_datasets import DatasetRow
from tandem.launch.bench_serving import report, run_benchmark
from tandem.launch.managed_server import start_server


def side_order(sides: list[str], round_no: int) -> list[str]:
    """The order the two sides run in round `round_no`: as given in even rounds, swapped in odd ones."""
    return sides if round_no % 2 == 0 else sides[::-1]


def run_rounds(args: argparse.Namespace, rows: list[DatasetRow], urls: dict[str, str], rounds: int) -> dict[str, list]:
    """Every row through each side's URL, `rounds` times, alternating; each side's reports in order."""
    each = copy.copy(args)
    each.output_file, each.plot, each.flush_cache = None, None, False
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in urls}
    for round_no in range(rounds):
        for side in side_order(list(urls), round_no):
            print(f"\n== round {round_no + 1}: {side} ({urls[side]})", flush=True)
            _flush_cache(urls[side])
            results, duration, t0 = asyncio.run(run_benchmark(each, rows, urls[side]))
            runs[side].append(report(each, results, duration, t0))
    return runs


def _flush_cache(base_url: str) -> None:
    import requests

    requests.post(base_url + "/flush_cache", json={}, timeout=60).raise_for_status()


def summarize(runs: dict[str, list[dict[str, Any]]], label: str) -> dict[str, Any]:
    """Pool each side's rounds, print the table and `label` (second side / first side), return both."""
    first, second = list(runs)
    summary = {side: pooled(rs) for side, rs in runs.items()}
    ratio = summary[second]["output_throughput"] / summary[first]["output_throughput"]
    pairs = [b["total_output_tokens"] / b["duration_s"] / (a["total_output_tokens"] / a["duration_s"])
             for a, b in zip(runs[first], runs[second])]
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


def run_via_gateway(args: argparse.Namespace, rows: list[DatasetRow], base_url: str) -> dict[str, Any]:
    from tandem.launch.managed_gateway import start_gateway

    with start_gateway([base_url]) as gateway_url:
        runs = run_rounds(args, rows, {"direct": base_url, "gateway": gateway_url}, args.gateway_rounds)
    combined = summarize(runs, "gateway / direct")
    combined["gateway_over_direct"] = combined.pop("ratio")
    return _write(args, combined, "gateway")


@contextlib.contextmanager
def overlap_servers(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Two servers from --server-args, overlap schedule off and on; both stopped afterwards. Only
    one serves at a time: the other's scheduler sleeps in its receive poll."""
    off_args = f"{args.server_args} --disable-overlap-schedule"
    with start_server(off_args, args.server_module, args.launch_timeout) as (off_url, _), \
            start_server(args.server_args, args.server_module, args.launch_timeout) as (on_url, _):
        yield {"overlap off": off_url, "overlap on": on_url}


def run_overlap_ab(args: argparse.Namespace, rows: list[DatasetRow]) -> dict[str, Any]:
    with overlap_servers(args) as urls:
        runs = run_rounds(args, rows, urls, args.overlap_rounds)
    combined = summarize(runs, "overlap on / off")
    combined["overlap_on_over_off"] = combined.pop("ratio")
    return _write(args, combined, "overlap on")


def _write(args: argparse.Namespace, combined: dict[str, Any], main_side: str) -> dict[str, Any]:
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(combined, f, indent=2)
    sides = [combined[side] for side in combined["rounds"]]
    return {**combined[main_side], "completed": min(m["completed"] for m in sides)}

"""Per-request timing records and the aggregate metrics of `tandem bench serving`.

Definitions follow SGLang's `bench_serving` (native `/generate` backend):

- TTFT: request start to the first streamed chunk that carries >= 1 output token.
- ITL: for every later chunk that carries n >= 1 new tokens, the gap since the previous
  token-carrying chunk is split evenly, contributing n values of gap / n. Chunks with no new
  tokens are ignored (they neither add values nor move the "previous chunk" time). Tokens that
  arrive together with the first token are covered by TTFT and add no ITL values.
- TPOT: (e2e - ttft) / (output_tokens - 1), only for requests with more than one output token.
- E2E latency: request start to the last line of the stream (the `[DONE]` line).
- Output tokens come from meta_info.completion_tokens, cached tokens from
  meta_info.cached_tokens; cache hit rate = total cached tokens / total input tokens.
- Empty samples give 0.0 (as SGLang's `np.mean(x or 0)`), so the JSON never holds NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Summary statistics computed for every latency series, in result-key order.
STAT_NAMES = ("mean", "median", "std", "p90", "p95", "p99", "max")
LATENCY_SERIES = ("ttft", "itl", "tpot", "e2e_latency")


@dataclass
class RequestResult:
    """What one benchmark request produced; times are absolute `time.perf_counter()` values."""

    prompt_len: int = 0
    start: float = 0.0
    success: bool = False
    error: str = ""
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    # token-carrying chunks: arrival time and number of new tokens (for throughput over time)
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    tokens_seen: int = 0

    @property
    def end(self) -> float:
        return self.start + self.latency


def record_chunk(res: RequestResult, now: float, total_tokens: int) -> None:
    """Account one streamed chunk whose cumulative output length is `total_tokens`."""
    new = total_tokens - res.tokens_seen
    if new <= 0:
        return
    if not res.chunk_times:
        res.ttft = now - res.start
    else:
        gap = (now - res.chunk_times[-1]) / new
        res.itl.extend([gap] * new)
    res.tokens_seen = total_tokens
    res.chunk_times.append(now)
    res.chunk_tokens.append(new)


def finish_request(res: RequestResult, now: float) -> None:
    """Close a successful stream: e2e latency, and TTFT for a stream that never sent a token."""
    res.latency = now - res.start
    if not res.chunk_times:
        res.ttft = res.latency
    if res.output_len == 0:
        res.output_len = res.tokens_seen
    res.success = True


def tpot(res: RequestResult) -> float | None:
    """Time per output token excluding the first; None for single-token requests."""
    if res.output_len <= 1:
        return None
    return (res.latency - res.ttft) / (res.output_len - 1)


def summarize(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/median/std/p90/p95/p99/max of `values` (seconds) in milliseconds by default."""
    if not values:
        return {name: 0.0 for name in STAT_NAMES}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        "p90": float(np.percentile(arr, 90)),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def throughput_timeline(
    results: list[RequestResult], t0: float, bin_s: float = 1.0
) -> list[tuple[float, float]]:
    """Output tokens/s in `bin_s`-wide bins from `t0`: (bin start in s, tokens per second)."""
    times: list[float] = []
    counts: list[int] = []
    for res in results:
        times.extend(res.chunk_times)
        counts.extend(res.chunk_tokens)
    if not times:
        return []
    idx = np.floor((np.asarray(times) - t0) / bin_s).astype(np.int64).clip(min=0)
    sums = np.bincount(idx, weights=np.asarray(counts, dtype=np.float64))
    return [(i * bin_s, float(s) / bin_s) for i, s in enumerate(sums)]


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once (sweep over start/end events; ends sort first)."""
    events = [(r.start, 1) for r in results] + [(r.end, -1) for r in results]
    events.sort(key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def compute_metrics(
    results: list[RequestResult], duration_s: float, t0: float | None = None
) -> dict[str, Any]:
    """Aggregate the run into the flat snake_case dict written to JSON."""
    ok = [r for r in results if r.success]
    dur = max(duration_s, 1e-9)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    total_cached = sum(r.cached_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "itl": [v for r in ok for v in r.itl],
        "tpot": [t for r in ok if (t := tpot(r)) is not None],
        "e2e_latency": [r.latency for r in ok],
    }
    start = t0 if t0 is not None else min((r.start for r in results), default=0.0)
    timeline = throughput_timeline(results, start)
    out: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": total_cached,
        "cache_hit_rate": total_cached / total_in if total_in else 0.0,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "peak_output_throughput": max((v for _, v in timeline), default=0.0),
        "peak_concurrent_requests": peak_concurrency(results),
        "concurrency": sum(series["e2e_latency"]) / dur,
    }
    for name in LATENCY_SERIES:
        for stat, value in summarize(series[name]).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def _line(label: str, value: Any, fmt: str = "") -> str:
    return f"{label:<40} {format(value, fmt):<10}".rstrip()


def _section(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^50}"


def _latency_lines(m: dict[str, Any], key: str, label: str, stats: tuple[str, ...]) -> list[str]:
    names = {"mean": "Mean", "median": "Median", "p90": "P90", "p95": "P95", "p99": "P99",
             "max": "Max", "std": "Std"}
    return [_line(f"{names[s]} {label} (ms):", m[f"{s}_{key}_ms"], ".2f") for s in stats]


def format_result_block(m: dict[str, Any], header: dict[str, Any]) -> str:
    """SGLang's bordered result block, plus tandem's failed/cached-token/hit-rate lines."""
    lines = [_section(" Serving Benchmark Result ", "=")]
    lines += [_line(f"{k}:", v) for k, v in header.items()]
    lines += [
        _line("Successful requests:", m["completed"]),
        _line("Failed requests:", m["failed"]),
        _line("Benchmark duration (s):", m["duration_s"], ".2f"),
        _line("Total input tokens:", m["total_input_tokens"]),
        _line("Total generated tokens:", m["total_output_tokens"]),
        _line("Total cached tokens:", m["total_cached_tokens"]),
        _line("Cache hit rate (%):", 100.0 * m["cache_hit_rate"], ".2f"),
        _line("Request throughput (req/s):", m["request_throughput"], ".2f"),
        _line("Input token throughput (tok/s):", m["input_throughput"], ".2f"),
        _line("Output token throughput (tok/s):", m["output_throughput"], ".2f"),
        _line("Peak output token throughput (tok/s):", m["peak_output_throughput"], ".2f"),
        _line("Peak concurrent requests:", m["peak_concurrent_requests"]),
        _line("Total token throughput (tok/s):", m["total_throughput"], ".2f"),
        _line("Concurrency:", m["concurrency"], ".2f"),
        *([_line("Accept length:", m["accept_length"], ".2f")] if m.get("accept_length") is not None else []),
        _section("End-to-End Latency"),
        *_latency_lines(m, "e2e_latency", "E2E Latency", ("mean", "median", "p90", "p99")),
        _section("Time to First Token"),
        *_latency_lines(m, "ttft", "TTFT", ("mean", "median", "p90", "p99")),
        _section("Time per Output Token (excl. 1st token)"),
        *_latency_lines(m, "tpot", "TPOT", ("mean", "median", "p90", "p99")),
        _section("Inter-Token Latency"),
        *_latency_lines(m, "itl", "ITL", ("mean", "median", "p90", "p95", "p99", "max")),
        "=" * 50,
    ]
    return "\n".join(lines)


def plot_results(results: list[RequestResult], t0: float, path: str) -> None:
    """Latency CDFs (TTFT, ITL, E2E) and output tokens/s over time, saved as an image."""
    import matplotlib  # lazy: plotting is optional and matplotlib is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    cdfs = {
        "TTFT": [r.ttft * 1000 for r in ok],
        "ITL": [v * 1000 for r in ok for v in r.itl],
        "E2E latency": [r.latency * 1000 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, values) in zip(axes.flat, cdfs.items()):
        xs = np.sort(np.asarray(values, dtype=np.float64))
        ax.plot(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), drawstyle="steps-post")
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples")
        ax.grid(alpha=0.3)
    timeline = throughput_timeline(results, t0)
    ax = axes.flat[3]
    ax.plot([t for t, _ in timeline], [v for _, v in timeline], marker=".")
    ax.set(title="Output throughput (1 s bins)", xlabel="time since start (s)", ylabel="tok/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

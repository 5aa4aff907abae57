"""Metric definitions of `tandem bench serving` on hand-built timings (no network)."""
from __future__ import annotations

import math

import pytest

from tandem.launch.bench_metrics import (
    RequestResult,
    compute_metrics,
    finish_request,
    format_result_block,
    peak_concurrency,
    record_chunk,
    summarize,
    throughput_timeline,
    tpot,
)


def _stream(start: float, chunks: list[tuple[float, int]], end: float) -> RequestResult:
    """A successful request that received (time, cumulative tokens) chunks, done at `end`."""
    res = RequestResult(prompt_len=10, start=start)
    for now, total in chunks:
        record_chunk(res, now, total)
    finish_request(res, end)
    return res


def test_ttft_itl_split_multi_token_chunk_and_ignore_empty_chunk() -> None:
    # tokens: 1 at +0.1, 1 at +0.3, 3 at +0.6, a no-new-token chunk at +0.7, [DONE] at +0.8
    res = _stream(10.0, [(10.1, 1), (10.3, 2), (10.6, 5), (10.7, 5)], 10.8)
    assert res.ttft == pytest.approx(0.1)
    # the 3-token chunk contributes three values of 0.3 / 3
    assert res.itl == pytest.approx([0.2, 0.1, 0.1, 0.1])
    assert res.latency == pytest.approx(0.8)
    assert res.output_len == 5
    assert tpot(res) == pytest.approx((0.8 - 0.1) / 4)
    assert res.chunk_tokens == [1, 1, 3]


def test_tokens_in_first_chunk_count_toward_ttft_only() -> None:
    res = _stream(0.0, [(0.2, 3), (0.5, 4)], 0.5)
    assert res.ttft == pytest.approx(0.2)
    assert res.itl == pytest.approx([0.3])
    assert tpot(res) == pytest.approx(0.3 / 3)


def test_itl_gap_measured_from_last_token_chunk_not_empty_chunk() -> None:
    # the empty chunk at 0.25 must not move the reference time
    res = _stream(0.0, [(0.1, 1), (0.25, 1), (0.4, 2)], 0.4)
    assert res.itl == pytest.approx([0.3])


def test_single_token_request_excluded_from_tpot() -> None:
    res = _stream(0.0, [(0.2, 1)], 0.25)
    assert tpot(res) is None
    assert res.itl == []


def test_stream_without_tokens_has_ttft_equal_to_latency() -> None:
    res = _stream(1.0, [], 1.5)
    assert res.ttft == pytest.approx(0.5)
    assert res.output_len == 0


def test_summarize_percentiles_and_empty() -> None:
    s = summarize([0.2, 0.1, 0.1, 0.1])  # seconds -> ms
    assert s["mean"] == pytest.approx(125.0)
    assert s["median"] == pytest.approx(100.0)
    assert s["std"] == pytest.approx(math.sqrt(1875.0))
    # linear interpolation over sorted [100, 100, 100, 200]: rank 0.9 * 3 = 2.7
    assert s["p90"] == pytest.approx(170.0)
    assert s["p99"] == pytest.approx(197.0)
    assert s["max"] == pytest.approx(200.0)
    assert summarize([]) == {k: 0.0 for k in s}


def _three_results() -> list[RequestResult]:
    r1 = _stream(10.0, [(10.1, 1), (10.3, 2), (10.6, 5), (10.7, 5)], 10.8)
    r1.cached_tokens = 4
    r2 = _stream(10.0, [(10.2, 1)], 10.25)
    r2.prompt_len = 30
    r3 = RequestResult(prompt_len=99, start=10.0, latency=0.3, error="HTTP 500: boom")
    return [r1, r2, r3]


def test_compute_metrics_aggregates() -> None:
    m = compute_metrics(_three_results(), duration_s=2.0, t0=10.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 40  # failed request's prompt not counted
    assert m["total_output_tokens"] == 6
    assert m["total_cached_tokens"] == 4
    assert m["cache_hit_rate"] == pytest.approx(4 / 40)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["input_throughput"] == pytest.approx(20.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_throughput"] == pytest.approx(23.0)
    assert m["concurrency"] == pytest.approx((0.8 + 0.25) / 2.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(150.0)
    assert m["mean_e2e_latency_ms"] == pytest.approx(525.0)
    # TPOT only from the 5-token request
    assert m["mean_tpot_ms"] == pytest.approx(175.0)
    assert m["p99_tpot_ms"] == pytest.approx(175.0)
    assert m["mean_itl_ms"] == pytest.approx(125.0)
    assert m["p90_itl_ms"] == pytest.approx(170.0)
    assert m["max_itl_ms"] == pytest.approx(200.0)
    assert m["peak_output_throughput"] == pytest.approx(6.0)  # all 6 tokens in the first bin
    assert m["peak_concurrent_requests"] == 3
    for series in ("ttft", "itl", "tpot", "e2e_latency"):
        for stat in ("mean", "median", "std", "p90", "p95", "p99", "max"):
            assert math.isfinite(m[f"{stat}_{series}_ms"])


def test_compute_metrics_all_failed_is_zero_not_nan() -> None:
    m = compute_metrics([RequestResult(error="x")], duration_s=1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["cache_hit_rate"] == 0.0


def test_throughput_timeline_bins() -> None:
    a = RequestResult(chunk_times=[0.2, 0.9, 1.5], chunk_tokens=[1, 2, 4])
    b = RequestResult(chunk_times=[3.1], chunk_tokens=[5])
    assert throughput_timeline([a, b], t0=0.0) == [(0.0, 3.0), (1.0, 4.0), (2.0, 0.0), (3.0, 5.0)]
    assert throughput_timeline([a], t0=0.0, bin_s=0.5)[0] == (0.0, 2.0)
    assert throughput_timeline([], t0=0.0) == []


def test_peak_concurrency_back_to_back_requests_do_not_overlap() -> None:
    rs = [RequestResult(start=0.0, latency=1.0), RequestResult(start=1.0, latency=1.0),
          RequestResult(start=0.5, latency=0.2)]
    assert peak_concurrency(rs) == 2


def test_result_block_has_sglang_labels() -> None:
    m = compute_metrics(_three_results(), duration_s=2.0, t0=10.0)
    block = format_result_block(m, {"Backend": "sglang", "Traffic request rate": float("inf")})
    lines = block.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for label in ("Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                  "Total generated tokens:", "Request throughput (req/s):",
                  "Input token throughput (tok/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean ITL (ms):",
                  "P95 ITL (ms):", "Mean TPOT (ms):", "Mean E2E Latency (ms):",
                  "Total cached tokens:", "Cache hit rate (%):", "Concurrency:"):
        assert any(line.startswith(label) for line in lines), label
    assert "Mean TTFT (ms):                          150.00" in block
    assert "Cache hit rate (%):                      10.00" in block


def test_accept_length_line_only_for_speculative_servers() -> None:
    m = compute_metrics(_three_results(), duration_s=2.0, t0=10.0)
    assert "Accept length" not in format_result_block(m, {})
    block = format_result_block({**m, "accept_length": 2.456}, {})
    assert "Accept length:                           2.46" in block

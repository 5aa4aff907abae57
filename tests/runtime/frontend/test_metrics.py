"""ServerMetrics without a server: SGLang's names, counts by finish type, latency histograms."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tandem.runtime.frontend.metrics import ServerMetrics


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) + (s.labels.get("le"),))] = s.value
    return out


def _get(samples: dict, name: str, le: str | None = None, **labels) -> float:
    want = {"model_name": "m", **labels}
    return next(v for (n, key), v in samples.items() if n == name and dict(k for k in key[:-1]) == want
                and key[-1] == le)


def test_request_metrics_and_scheduler_gauges():
    m = ServerMetrics("m")
    m.on_output(0.5, None, 1)  # streaming: the first token after 0.5 s
    m.on_output(0.7, 0.2, 2)  # two more 0.2 s later: 0.1 s each
    m.on_finish("length", 0.8, prompt_tokens=10, completion_tokens=3, cached_tokens=4)
    m.on_output(2.0, None, 5)  # non-streaming: everything in one output
    m.on_finish("abort", 2.0, prompt_tokens=6, completion_tokens=5, cached_tokens=0)
    m.update_from_scheduler({"num_running_reqs": 3, "num_queue_reqs": 2, "kv_slots_used": 25,
                             "max_total_num_tokens": 100, "gen_throughput": 12.5, "device_idle_fraction": 0.01,
                             "num_retractions": 7, "num_grammar_queue_reqs": 1, "avg_spec_accept_length": 2.5,
                             "spec_accept_rate": 0.75})
    s = _samples(m)
    assert _get(s, "sglang:num_requests_total") == 2  # one series per worker, as SGLang's
    assert _get(s, "tandem:num_requests_by_finish_type_total", finish_type="length") == 1
    assert _get(s, "tandem:num_requests_by_finish_type_total", finish_type="abort") == 1
    assert _get(s, "sglang:num_aborted_requests_total") == 1
    assert _get(s, "sglang:prompt_tokens_total") == 16 and _get(s, "sglang:generation_tokens_total") == 8
    assert _get(s, "sglang:cache_hit_rate") == 4 / 16
    assert _get(s, "sglang:time_to_first_token_seconds_count") == 2
    assert _get(s, "sglang:time_to_first_token_seconds_sum") == 2.5
    # only the streamed request's two later tokens (0.1 s each); a first chunk is TTFT alone
    assert _get(s, "sglang:inter_token_latency_seconds_count") == 2
    assert abs(_get(s, "sglang:inter_token_latency_seconds_sum") - 0.2) < 1e-9
    assert _get(s, "sglang:inter_token_latency_seconds_bucket", le="0.08") == 0
    assert _get(s, "sglang:inter_token_latency_seconds_bucket", le="0.1") == 2
    assert _get(s, "sglang:e2e_request_latency_seconds_count") == 2
    assert _get(s, "sglang:num_running_reqs") == 3 and _get(s, "sglang:num_queue_reqs") == 2
    assert _get(s, "sglang:token_usage") == 0.25 and _get(s, "sglang:gen_throughput") == 12.5
    assert _get(s, "tandem:num_retractions") == 7 and _get(s, "tandem:device_idle_fraction") == 0.01
    assert _get(s, "sglang:num_used_tokens") == 25 and _get(s, "sglang:num_grammar_queue_reqs") == 1
    assert _get(s, "sglang:spec_accept_length") == 2.5 and _get(s, "sglang:spec_accept_rate") == 0.75

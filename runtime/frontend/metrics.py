"""Prometheus metrics with SGLang's names (`sglang:*`), so existing dashboards and the gateway
read a tandem worker as they read an SGLang one, plus `tandem:*` gauges of our own.

Request-level metrics are recorded in the main process as outputs arrive (time to first token,
inter-token latency, end-to-end latency, token and request counts); scheduler gauges (running,
queued and grammar-queued requests, KV usage, throughput, speculative acceptance, device idle,
retractions) are refreshed from the
scheduler's server info at scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# SGLang's default buckets, so dashboards' heatmaps and quantiles read the same rows
_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
_E2E_BUCKETS = (*_TTFT_BUCKETS, 600, 1200, 1800, 2400)
_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
                0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name}
        names = list(self.labels)
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**self.labels)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "Requests decoding or in prefill")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Requests waiting to be admitted")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "KV slots held by requests (not the evictable cache)")
        self.token_usage = gauge("sglang:token_usage", "Share of KV slots in use")
        self.num_grammar_queue_reqs = gauge("sglang:num_grammar_queue_reqs", "Requests waiting for their grammar")
        self.spec_accept_length = gauge("sglang:spec_accept_length", "Tokens per speculative verify (mean)")
        self.spec_accept_rate = gauge("sglang:spec_accept_rate", "Share of drafts accepted")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens")
        self.gen_throughput = gauge("sglang:gen_throughput", "Generated tokens per second (recent)")
        self.device_idle = gauge("tandem:device_idle_fraction", "Share of busy time the device waited for a step")
        self.retractions = gauge("tandem:num_retractions", "Requests retracted for KV memory since start")
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens of finished requests", names,
                                     registry=r).labels(**self.labels)
        self.generation_tokens = Counter("sglang:generation_tokens", "Generated tokens of finished requests", names,
                                         registry=r).labels(**self.labels)
        self.cached_tokens = Counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache", names,
                                     registry=r).labels(**self.labels)
        self.num_requests = Counter("sglang:num_requests", "Finished requests", names, registry=r).labels(**self.labels)
        self.aborts = Counter("sglang:num_aborted_requests", "Requests that ended with an abort", names,
                              registry=r).labels(**self.labels)
        self.by_finish_type = Counter("tandem:num_requests_by_finish_type", "Finished requests by finish type",
                                      [*names, "finish_type"], registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", names,
                              buckets=_TTFT_BUCKETS, registry=r).labels(**self.labels)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Time between output tokens", names,
                             buckets=_ITL_BUCKETS, registry=r).labels(**self.labels)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Request latency, end to end", names,
                             buckets=_E2E_BUCKETS, registry=r).labels(**self.labels)
        self._prompt_total = 0
        self._cached_total = 0

    # -- per request (main process, as outputs arrive) -------------------------------------------------
    def on_output(self, since_start_s: float, since_last_s: float | None, new_tokens: int) -> None:
        """An output with `new_tokens` arrived; `since_last_s` is None for the first one, which
        counts as the time to first token only (as SGLang's: the tokens that came with it have no
        interval of their own)."""
        if new_tokens <= 0:
            return
        if since_last_s is None:
            self.ttft.observe(since_start_s)
            return
        self._observe_intervals(since_last_s, new_tokens)

    def _observe_intervals(self, interval_s: float, tokens: int) -> None:
        """`tokens` observations of interval_s / tokens in one step, as SGLang's collector does
        (prometheus_client observes one value a call; a chunk can carry thousands)."""
        self.itl._sum.inc(interval_s)
        per_token = interval_s / tokens
        for bucket, bound in zip(self.itl._buckets, self.itl._upper_bounds):
            if per_token <= bound:
                bucket.inc(tokens)
                break

    def on_finish(self, finish_type: str, e2e_s: float, prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int) -> None:
        self.num_requests.inc()
        self.by_finish_type.labels(**self.labels, finish_type=finish_type).inc()
        if finish_type == "abort":
            self.aborts.inc()
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        self.cache_hit_rate.set(self.prefix_hit_rate)

    @property
    def prefix_hit_rate(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    # -- scheduler gauges (at scrape time) ----------------------------------------------------------------
    def update_from_scheduler(self, info: dict) -> None:
        self.num_running_reqs.set(info.get("num_running_reqs", 0))
        self.num_queue_reqs.set(info.get("num_queue_reqs", 0))
        self.num_grammar_queue_reqs.set(info.get("num_grammar_queue_reqs", 0))
        total, used = info.get("max_total_num_tokens") or 0, info.get("kv_slots_used", 0)
        self.num_used_tokens.set(used)
        self.token_usage.set(used / total if total else 0.0)
        self.spec_accept_length.set(info.get("avg_spec_accept_length", 0.0))
        self.spec_accept_rate.set(info.get("spec_accept_rate", 0.0))
        self.gen_throughput.set(info.get("gen_throughput", 0.0))
        self.device_idle.set(info.get("device_idle_fraction", 0.0))
        self.retractions.set(info.get("num_retractions", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)

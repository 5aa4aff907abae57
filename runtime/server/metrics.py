"""Prometheus metrics with SGLang's names (`sglang:*`), so existing dashboards and the gateway
read a tandem worker as they read an SGLang one, plus `tandem:*` gauges of our own.

Request-level metrics are recorded in the main process as outputs arrive (time to first token,
inter-token latency, end-to-end latency, token and request counts); scheduler gauges (running
and queued requests, KV usage, throughput, device idle, retractions) are refreshed from the
scheduler's server info at scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0)
_MAX_ITL_OBSERVATIONS = 64  # per arrival: one big non-streaming chunk must not cost a loop of thousands


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
        self.token_usage = gauge("sglang:token_usage", "Share of KV slots in use")
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
        self.num_requests = Counter("sglang:num_requests", "Finished requests by finish type",
                                    [*names, "finish_type"], registry=r)
        self.aborts = Counter("tandem:num_aborted_requests", "Requests that ended with an abort", names,
                              registry=r).labels(**self.labels)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", names,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(**self.labels)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Time between output tokens", names,
                             buckets=_ITL_BUCKETS, registry=r).labels(**self.labels)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Request latency, end to end", names,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(**self.labels)
        self._prompt_total = 0
        self._cached_total = 0

    # -- per request (main process, as outputs arrive) -------------------------------------------------
    def on_output(self, since_start_s: float, since_last_s: float | None, new_tokens: int) -> None:
        """An output with `new_tokens` arrived; `since_last_s` is None for the first one."""
        if new_tokens <= 0:
            return
        if since_last_s is None:
            self.ttft.observe(since_start_s)
            new_tokens -= 1
            if new_tokens <= 0:
                return
            since_last_s = 0.0  # the rest of a first chunk arrived with the first token
        per_token = since_last_s / new_tokens
        for _ in range(min(new_tokens, _MAX_ITL_OBSERVATIONS)):
            self.itl.observe(per_token)

    def on_finish(self, finish_type: str, e2e_s: float, prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int) -> None:
        self.num_requests.labels(**self.labels, finish_type=finish_type).inc()
        if finish_type == "abort":
            self.aborts.inc()
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        self.cache_hit_rate.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)

    @property
    def prefix_hit_rate(self) -> float:
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    # -- scheduler gauges (at scrape time) ----------------------------------------------------------------
    def update_from_scheduler(self, info: dict) -> None:
        self.num_running_reqs.set(info.get("num_running_reqs", 0))
        self.num_queue_reqs.set(info.get("num_queue_reqs", 0))
        total = info.get("max_total_num_tokens") or 0
        self.token_usage.set(info.get("kv_slots_used", 0) / total if total else 0.0)
        self.gen_throughput.set(info.get("gen_throughput", 0.0))
        self.device_idle.set(info.get("device_idle_fraction", 0.0))
        self.retractions.set(info.get("num_retractions", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)

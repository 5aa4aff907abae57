"""SGLang's load report (`GET /v1/loads`, gRPC GetLoad / GetLoads) from the scheduler's info.

One scheduler (dp_rank 0) today; the shape is SGLang's so the gateway's load view reads it.
"""
from __future__ import annotations

import datetime
from typing import Any

from tandem.runtime.value_checks import ValidationError


def scheduler_load(info: dict[str, Any], max_running_requests: int, cache_hit_rate: float) -> dict[str, Any]:
    total = info.get("max_total_num_tokens") or 0
    used = info.get("kv_slots_used", 0)
    running, waiting = info.get("num_running_reqs", 0), info.get("num_queue_reqs", 0)
    return {
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_total_reqs": running + waiting,
        "num_used_tokens": used, "max_total_num_tokens": total, "token_usage": used / total if total else 0.0,
        "gen_throughput": info.get("gen_throughput", 0.0), "cache_hit_rate": cache_hit_rate,
        "utilization": running / max_running_requests if max_running_requests else 0.0,
        "max_running_requests": max_running_requests,
        "queues": {"waiting": waiting - info.get("num_grammar_queue_reqs", 0),
                   "grammar": info.get("num_grammar_queue_reqs", 0), "paused": 0, "retracted": 0},
    }


SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})  # SGLang's


def loads_report(load: dict[str, Any], version: str, include: set[str] | None = None) -> dict[str, Any]:
    """`include` (SGLang's ?include=core,queues,...): the optional sections kept; None keeps all.
    Of SGLang's sections this server has core and queues; an unknown one is a ValidationError."""
    if include is not None and (unknown := include - SECTIONS):
        raise ValidationError("include", f"unknown sections {sorted(unknown)}; SGLang's are {sorted(SECTIONS)}")
    if include is not None and "all" not in include and "queues" not in include:
        load = {k: v for k, v in load.items() if k != "queues"}
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": version, "dp_rank_count": 1, "loads": [load],
        "aggregate": {"total_running_reqs": load["num_running_reqs"], "total_waiting_reqs": load["num_waiting_reqs"],
                      "total_reqs": load["num_total_reqs"], "avg_token_usage": load["token_usage"],
                      "avg_throughput": load["gen_throughput"], "avg_utilization": load["utilization"]},
    }

"""SGLang's load report from the scheduler's counters, without a server."""
from __future__ import annotations

import pytest

from tandem.runtime.frontend.loads import loads_report, scheduler_load
from tandem.runtime.value_checks import ValidationError

INFO = {"max_total_num_tokens": 1000, "kv_slots_used": 250, "num_running_reqs": 3, "num_queue_reqs": 5,
        "num_grammar_queue_reqs": 2, "gen_throughput": 12.5}


def test_the_load_in_sglangs_shape():
    load = scheduler_load(INFO, max_running_requests=4, cache_hit_rate=0.5)
    assert (load["num_total_reqs"], load["token_usage"], load["utilization"]) == (8, 0.25, 0.75)
    assert load["queues"] == {"waiting": 3, "grammar": 2, "paused": 0, "retracted": 0}
    report = loads_report(load, "v")
    assert report["dp_rank_count"] == 1 and report["aggregate"]["total_reqs"] == 8


def test_include_keeps_the_queues_only_when_asked_and_refuses_unknown_sections():
    load = scheduler_load(INFO, 4, 0.0)
    assert "queues" not in loads_report(load, "v", {"core"})["loads"][0]
    assert "queues" in loads_report(load, "v", {"queues"})["loads"][0]
    assert "queues" in loads_report(load, "v", {"all"})["loads"][0]
    with pytest.raises(ValidationError, match="^include unknown sections"):
        loads_report(load, "v", {"core", "bogus"})

"""No livelock under the soak's pressure, process-free: forced retraction every 3 decode steps,
priority scheduling with preemption, chunked prefill and a KV pool too small for everyone, with
arrivals of random priorities for hundreds of steps. Every request that is retracted again has
gained output since its last retraction, and once arrivals stop every request finishes."""
from __future__ import annotations

import random

import pytest
from tests.runtime.scheduler.fake_worker import CONTEXT, make_core


@pytest.mark.parametrize("preemption", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_every_retracted_request_makes_progress_and_all_finish(preemption, overlap):
    core = make_core(max_total_tokens=1500, max_running_requests=16, chunked_prefill_size=64,
                     enable_priority_scheduling=True, priority_preemption=preemption, force_retract_every=3)
    rng = random.Random(7)
    reqs, at_retraction = [], {}
    in_flight = None
    arrivals_until, steps = 400, 0
    while steps < 20_000:
        steps += 1
        if steps < arrivals_until:
            while sum(not r.finished for r in reqs) < 24:
                prompt = rng.randint(4, 160)
                reqs.append(core.add(f"r{len(reqs)}", prompt, max_new_tokens=rng.randint(1, min(64, CONTEXT - prompt)),
                                     priority=rng.randint(0, 20)))
        _, in_flight = core.step(in_flight, overlap)
        for r in reqs:
            if r.retract_count and at_retraction.get(r.rid, (0, -1))[0] != r.retract_count:
                last_count, last_len = at_retraction.get(r.rid, (0, -1))
                assert r.retract_count == last_count + 1, r.rid  # one retraction at a time
                assert len(r.output_ids) + r.outputs_in_flight > last_len, (r.rid, r.retract_count, len(r.output_ids))
                at_retraction[r.rid] = (r.retract_count, len(r.output_ids) + r.outputs_in_flight)
        if steps > arrivals_until and in_flight is None and not core.planner.has_work():
            break
    assert steps < 20_000, "the core did not go idle after arrivals stopped"
    assert core.planner.num_retractions > 50  # the pressure was real
    assert all(r.finished for r in reqs)
    assert {r.finished_reason.type for r in reqs} == {"length"}, {r.finished_reason for r in reqs}
    for r in reqs:  # the fake model's tokens: nothing lost or repeated across retractions
        assert len(r.output_ids) == r.sampling_params.max_new_tokens
    core.assert_no_leaks()

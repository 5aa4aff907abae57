"""Planner + PrefillAdder + KV manager without processes: admission, chunked prefill,
retraction, aborts, priority preemption and out-of-memory, on CPU tensors with a fake model."""
from __future__ import annotations

import time

import numpy as np
import torch
from tests.runtime.scheduler.fake_worker import fake_token, make_core

from tandem.ipc.messages import TokenizedGenerateReq
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.scheduler.request import Phase, Req


def _spans(batch) -> list[tuple[str, int, int, bool]]:
    return [(s.req.rid, s.prefix_len, s.extend_len, s.samples) for s in batch.spans]


def test_admission_stops_at_the_token_budget_and_chunks_the_overflow():
    core = make_core(max_prefill_tokens=10, chunked_prefill_size=-1)
    for rid in ("a", "b", "c", "d"):
        core.add(rid, 4)
    batch = core.plan()
    # a and b fit whole; c gets what is left of the budget and becomes the chunked request;
    # nothing is admitted behind a split prompt
    assert batch.mode == ForwardMode.EXTEND
    assert _spans(batch) == [("a", 0, 4, True), ("b", 0, 4, True), ("c", 0, 2, False)]
    assert [r.rid for r in core.planner.running] == ["a", "b"]
    assert core.planner.chunked.req.rid == "c" and [r.rid for r in core.planner.waiting] == ["d"]
    assert batch.job.sample_indices == [0, 1]
    assert batch.job.input_ids == [10, 11, 12, 13, 20, 21, 22, 23, 30, 31]


def test_the_chunk_size_caps_a_whole_prefill_step_as_in_sglang():
    core = make_core(chunked_prefill_size=4, max_prefill_tokens=100)
    for rid in "abc":
        core.add(rid, 3)
    assert _spans(core.plan()) == [("a", 0, 3, True), ("b", 0, 1, False)]


def test_chunked_prefill_runs_across_steps_and_samples_only_at_the_end():
    core = make_core(chunked_prefill_size=4)
    long = core.add("long", 10, max_new_tokens=2)
    batches = core.run(overlap=True)
    prefill = [(_spans(b), b.mode) for b in batches if b.mode == ForwardMode.EXTEND]
    assert prefill == [([("long", 0, 4, False)], ForwardMode.EXTEND), ([("long", 4, 4, False)], ForwardMode.EXTEND),
                       ([("long", 8, 2, True)], ForwardMode.EXTEND)]
    assert long.output_ids == [fake_token(10), fake_token(11)]
    core.assert_no_leaks()


def test_requests_behind_a_chunked_prompt_wait_for_its_last_chunk():
    core = make_core(chunked_prefill_size=4, max_prefill_tokens=6)
    core.add("long", 10)
    core.add("short", 2)
    first = core.plan()
    assert _spans(first) == [("long", 0, 4, False)]
    core.process(first)
    second = core.plan()
    assert _spans(second) == [("long", 4, 4, False)]  # a step computes at most 4 tokens: short waits
    core.process(second)
    third = core.plan()
    assert _spans(third) == [("long", 8, 2, True), ("short", 0, 2, True)]


def test_budget_reserve_and_memory_limit_admission():
    # 40 slots: a running request with 29 tokens still to decode holds back 8 (30%) of them
    core = make_core(max_total_tokens=40)
    core.add("a", 8, max_new_tokens=30)
    core.process(core.plan())
    core.add("b", 25, max_new_tokens=4)  # 25 + 8 + 1 (b's own reserve) > 32 free
    batch = core.plan()
    assert batch.mode == ForwardMode.DECODE and [r.rid for r in core.planner.waiting] == ["b"]
    core.process(batch)
    core.run()
    assert [r.rid for r in core.finished] == ["a", "b"]
    core.assert_no_leaks()


def test_max_running_requests_caps_admission():
    core = make_core(max_running_requests=2)
    for rid in "abc":
        core.add(rid, 3)
    batch = core.plan()
    assert [s.req.rid for s in batch.spans] == ["a", "b"] and [r.rid for r in core.planner.waiting] == ["c"]


def test_retraction_frees_the_newest_and_requeues_it_first_in_arrival_order():
    # 3 prompts of 4 tokens fill 12 of 15 slots; each decode step needs one slot per request
    core = make_core(max_total_tokens=15, radix=False)
    a, b, c = (core.add(rid, 4, max_new_tokens=6) for rid in "abc")
    prefill = core.plan()
    assert [s.req.rid for s in prefill.spans] == ["a", "b", "c"]
    core.process(prefill)
    core.process(core.plan())  # decode 1 takes the last 3 slots
    assert core.kv.available_tokens() == 0
    decode = core.plan()  # decode 2 does not fit: the newest (c) is retracted
    assert [s.req.rid for s in decode.spans] == ["a", "b"]
    assert c.retract_count == 1 and c.kv.req_pool_idx is None and c.kv.alloc_len == 0
    assert core.planner.waiting == [c] and core.planner.num_retractions == 1
    assert core.kv.available_tokens() == 5 - 2  # c's 5 slots came back, a and b took one each
    assert c.output_ids == [fake_token(4), fake_token(5)]  # what c produced is kept
    d = core.add("d", 2, max_new_tokens=1)
    core.process(decode)
    core.planner.policy.sort(core.planner.waiting)
    assert core.planner.waiting == [c, d]  # fcfs by arrival: the retracted request goes first
    core.run()
    for r in (a, b, c):  # retraction never changes what a request produces
        assert r.output_ids == [fake_token(p) for p in range(4, 10)], r.rid
    core.assert_no_leaks()


def test_forced_retraction_with_overlap_keeps_outputs_and_frees_everything():
    core = make_core(max_total_tokens=300, max_running_requests=4, force_retract_every=2, chunked_prefill_size=3)
    reqs = [core.add(f"r{i}", 5 + i, max_new_tokens=12) for i in range(6)]
    core.run(overlap=True)
    assert core.planner.num_retractions > 3
    for r in reqs:
        prompt = len(r.origin_input_ids)
        assert r.output_ids == [fake_token(p) for p in range(prompt, prompt + 12)], r.rid
    core.assert_no_leaks()


def test_abort_of_queued_running_and_chunked_requests():
    core = make_core(chunked_prefill_size=4, max_prefill_tokens=8)
    core.add("g1_0", 3, max_new_tokens=50)
    core.add("g2_0", 12, max_new_tokens=50)  # split: 1 token this step (chunk budget 4 - 3)
    core.add("g3_0", 3, max_new_tokens=50)
    first = core.plan()
    assert core.planner.chunked.req.rid == "g2_0" and [r.rid for r in core.planner.waiting] == ["g3_0"]
    # abort the queued one and the chunked one while the step that prefilled them is in flight
    assert [r.rid for r in core.abort("g3_")] == ["g3_0"]
    assert [r.rid for r in core.abort("g2_")] == ["g2_0"]
    assert core.planner.chunked is None and core.rows.num_deferred() == 1  # g2's row waits for the step
    core.process(first)
    assert core.rows.num_deferred() == 0
    assert [r.rid for r in core.abort("g1_")] == ["g1_0"]  # running
    assert core.abort("g9_") == [] and not core.planner.has_work()
    core.assert_no_leaks()


def test_abort_prefix_matches_one_group_only():
    core = make_core()
    core.add("00aa_0", 3)
    core.add("00aa_1", 3)
    core.add("00aab_0", 3)  # group ids have one length in practice; even so "00aa_" is exact
    assert core.abort("") == [] and core.abort() == []
    assert sorted(r.rid for r in core.abort("00aa_")) == ["00aa_0", "00aa_1"]
    assert [r.rid for r in core.planner.waiting] == ["00aab_0"]
    assert [r.rid for r in core.abort(abort_all=True)] == ["00aab_0"] and not core.planner.has_work()


def test_priority_preemption_retracts_the_least_urgent_running_request():
    core = make_core(max_running_requests=1, enable_priority_scheduling=True, priority_preemption=True)
    low = core.add("low", 3, max_new_tokens=8, priority=0)
    core.process(core.plan())
    core.add("mid", 3, priority=5)  # gap 5 < 10: waits
    batch = core.plan()
    assert batch.mode == ForwardMode.DECODE and low in core.planner.running and low.retract_count == 0
    core.process(batch)
    core.run()
    core2 = make_core(max_running_requests=1, enable_priority_scheduling=True, priority_preemption=True)
    low = core2.add("low", 3, max_new_tokens=8, priority=0)
    core2.process(core2.plan())
    high = core2.add("high", 3, max_new_tokens=2, priority=20)
    batch = core2.plan()
    assert [s.req.rid for s in batch.spans] == ["high"] and low.retract_count == 1
    core2.process(batch)
    core2.run()
    assert core2.finished.index(high) < core2.finished.index(low)
    assert low.output_ids == [fake_token(p) for p in range(3, 11)]
    core2.assert_no_leaks()



def test_preemption_needs_a_gap_above_the_threshold():
    """SGLang's preempt_to_schedule: priority_diff > --priority-scheduling-preemption-threshold
    (10); a gap of exactly 10 waits for a free slot."""
    for gap, preempts in ((10, False), (11, True)):
        core = make_core(max_running_requests=1, enable_priority_scheduling=True, priority_preemption=True)
        low = core.add("low", 3, max_new_tokens=8, priority=0)
        core.process(core.plan())
        core.add("urgent", 3, max_new_tokens=2, priority=gap)
        batch = core.plan()
        assert ([s.req.rid for s in batch.spans] == ["urgent"]) is preempts and low.retract_count == int(preempts)
    core = make_core(max_running_requests=1, enable_priority_scheduling=True, priority_preemption=True,
                     priority_scheduling_preemption_threshold=0)
    low = core.add("low", 3, max_new_tokens=8, priority=0)
    core.process(core.plan())
    core.add("urgent", 3, max_new_tokens=2, priority=1)
    assert [s.req.rid for s in core.plan().spans] == ["urgent"] and low.retract_count == 1



def test_preemption_retracts_as_many_as_the_arrival_needs_or_none():
    """SGLang's preempt_to_schedule: the least urgent running requests give way until the arrival
    fits; when even every preemptible one would not make room, none is retracted for nothing."""
    core = make_core(max_total_tokens=60, max_running_requests=2, enable_priority_scheduling=True, priority_preemption=True)
    a, b = core.add("a", 20, max_new_tokens=6, priority=0), core.add("b", 20, max_new_tokens=6, priority=0)
    core.process(core.plan())
    core.add("h", 40, max_new_tokens=2, priority=50)  # needs both a's and b's memory
    batch = core.plan()
    assert [s.req.rid for s in batch.spans] == ["h"] and a.retract_count == b.retract_count == 1
    core.process(batch)
    core.run()
    core.assert_no_leaks()
    core = make_core(max_total_tokens=60, max_running_requests=2, enable_priority_scheduling=True, priority_preemption=True)
    a, b = core.add("a", 20, max_new_tokens=6, priority=0), core.add("b", 20, max_new_tokens=6, priority=20)
    core.process(core.plan())
    core.add("h", 40, max_new_tokens=2, priority=25)  # only a is 10+ below: its memory alone is not enough
    batch = core.plan()
    assert batch.mode == ForwardMode.DECODE and a.retract_count == b.retract_count == 0

def test_low_priority_values_first_preempts_and_displaces_toward_small_values():
    """Under --schedule-low-priority-values-first, 0 preempts a running 20, and a full queue gives way
    to a smaller value, not a larger one (SGLang's direction = 1)."""
    core = make_core(max_running_requests=1, max_queued_requests=1, enable_priority_scheduling=True,
                     priority_preemption=True, schedule_low_priority_values_first=True)
    late = core.add("late_0", 3, max_new_tokens=8, priority=20)
    core.process(core.plan())
    queued = core.add("queued_0", 3, max_new_tokens=2, priority=None)  # no priority: sys.maxsize
    larger = core.add("larger_0", 3, priority=30)  # the full queue gives way: 30 outranks no priority
    smaller = core.add("smaller_0", 3, priority=5)  # and 5 outranks 30
    refused = core.add("refused_0", 3, priority=40, expect=Phase.DONE)  # 40 outranks nobody
    assert [(r.rid, r.finished_reason.status_code) for r in core.finished] == [
        ("queued_0", 503), ("larger_0", 503), ("refused_0", 503)]
    assert queued.finished_reason.message == "The request is aborted by a higher priority request."
    assert refused.finished_reason.message == "The request queue is full."
    assert core.planner.waiting == [smaller] and not larger.output_ids
    assert [s.req.rid for s in core.plan().spans] == ["smaller_0"] and late.retract_count == 1


def test_a_lone_request_that_cannot_grow_is_returned_as_out_of_memory():
    core = make_core(max_total_tokens=8, radix=False)
    r = core.add("r", 3, max_new_tokens=5)
    core.process(core.plan())
    hog = core.kv.allocator.alloc(core.kv.available_tokens())  # memory held by something else
    plan = core.planner.next_batch()
    assert plan.batch is None and [req for req, _ in plan.aborted] == [r]
    reason = plan.aborted[0][1]
    assert (reason.type, reason.status_code, reason.err_type) == ("abort", 500, "OutOfMemory")
    assert r in core.planner.running  # the planner does not finish it: the scheduler does
    core.finish(r, reason)
    core.kv.allocator.free(hog)
    core.assert_no_leaks()


def test_a_prompt_is_admitted_only_when_all_of_it_fits_not_just_its_first_chunk():
    # a decodes towards 70 tokens; b's 60-token prompt would fit a 16-token chunk at a time, and
    # its later chunks would take the memory a decodes into (a was then aborted, out of memory)
    core = make_core(max_total_tokens=100, chunked_prefill_size=16)
    a = core.add("a", 10, max_new_tokens=60)
    while len(a.output_ids) < 40:
        core.process(core.plan())
    b = core.add("b", 60, max_new_tokens=1)
    batch = core.plan()
    assert batch.mode == ForwardMode.DECODE and core.planner.waiting == [b]
    core.process(batch)
    core.run()
    assert [(r.rid, r.finished_reason.type) for r in core.finished] == [("a", "length"), ("b", "length")]
    assert a.output_ids == [fake_token(p) for p in range(10, 70)]
    core.assert_no_leaks()


def test_the_last_request_waits_for_in_flight_finishers_instead_of_running_out():
    # 30 slots: a's last token is in flight when b needs its next slot; a's KV comes back a step
    # later, so b waits for it (it was aborted out of memory, while it fits on its own)
    core = make_core(max_total_tokens=30, radix=False)
    core.add("a", 10, max_new_tokens=6)
    b = core.add("b", 10, max_new_tokens=12)
    core.run(overlap=True)
    assert [(r.rid, r.finished_reason.type) for r in core.finished] == [("a", "length"), ("b", "length")]
    assert b.output_ids == [fake_token(p) for p in range(10, 22)] and core.planner.num_retractions == 0
    core.assert_no_leaks()


def test_a_chunked_prompt_gives_its_memory_back_before_a_decoding_request_runs_out():
    core = make_core(max_total_tokens=40, chunked_prefill_size=4, radix=False)
    r = core.add("r", 3, max_new_tokens=20)
    core.process(core.plan())
    c = core.add("c", 12, max_new_tokens=4)
    first_chunk = core.plan()
    assert _spans(first_chunk) == [("c", 0, 4, False)]
    core.process(first_chunk)
    hog = core.kv.allocator.alloc(core.kv.available_tokens())  # memory held by something else
    batch = core.plan()  # c cannot continue and r cannot grow: c is requeued, r decodes
    assert batch.mode == ForwardMode.DECODE and [s.req for s in batch.spans] == [r]
    assert core.planner.chunked is None and core.planner.waiting == [c] and c.retract_count == 1
    core.process(batch)
    core.kv.allocator.free(hog)
    core.run()
    assert r.output_ids == [fake_token(p) for p in range(3, 23)]
    assert c.output_ids == [fake_token(p) for p in range(12, 16)]
    core.assert_no_leaks()


def test_request_timeout_ends_only_requests_never_admitted():
    core = make_core(request_timeout=5.0, force_retract_every=1)
    core.add("a", 5, max_new_tokens=20)
    b = core.add("b", 5, max_new_tokens=20)
    core.process(core.plan())
    core.process(core.plan())  # the forced retraction requeues b, which has output already
    assert core.planner.waiting == [b] and b.output_ids
    queued = core.add("queued", 5)
    later = time.monotonic() + 60
    assert core.core.expired_rids(later) == [queued.rid]


def test_n_siblings_share_the_in_flight_prefix_and_never_write_a_freed_slot():
    core = make_core(max_total_tokens=64)
    prompt = list(range(100, 108))
    sibs = [core.add(f"g_{i}", prompt, max_new_tokens=3) for i in range(3)]
    batch = core.plan()
    # the first sibling computes the prompt; the others reuse its in-flight KV but the last token
    assert [(s.prefix_len, s.extend_len) for s in batch.spans] == [(0, 8), (7, 1), (7, 1)]
    written = torch.cat([s.out_cache_loc for s in batch.spans])
    first_row = core.kv.req_to_token[sibs[0].kv.req_pool_idx, :8]
    assert set(written.tolist()) == set(first_row.tolist())  # duplicates go to the tree's own slots
    assert not core.kv.allocator._is_free[written].any()
    core.process(batch)
    core.run()
    assert all(s.output_ids == [fake_token(p) for p in range(8, 11)] for s in sibs)
    core.assert_no_leaks()


def test_a_request_without_priority_is_the_least_urgent():
    """SGLang's _set_or_validate_priority: no priority is the least urgent value, so it waits behind
    an explicit -1 (it was 0, ahead of every negative priority)."""
    core = make_core(max_running_requests=1, enable_priority_scheduling=True)
    core.add("none_0", 4, max_new_tokens=2, priority=None)
    explicit = core.add("neg_0", 4, max_new_tokens=2, priority=-1)
    assert [r.rid for r in core.plan().reqs] == [explicit.rid]


def test_a_full_queue_gives_way_to_a_more_urgent_arrival_only():
    """SGLang's _abort_on_queued_limit: with priority scheduling, an arrival strictly more urgent
    than the least urgent waiting request (lowest priority, newest) takes its place; otherwise, and
    always without priority scheduling, the arrival gets the 503."""
    core = make_core(max_running_requests=1, max_queued_requests=2, enable_priority_scheduling=True)
    low_old, low_new = core.add("low_old_0", 4, priority=1), core.add("low_new_0", 4, priority=1)

    def arrival(rid: str, priority: int | None) -> Req:
        msg = TokenizedGenerateReq(rid=rid, input_ids=np.arange(500, 504, dtype=np.int32), stream=False,
                                   sampling_params=SamplingParams(max_new_tokens=2),
                                   priority=priority)
        return Req.from_message(msg, 99, 0)

    for refused in (arrival("equal_0", 1), arrival("none_0", None)):
        assert core.core.queue_victim(refused) is None
        assert core.core.queue_error(refused).status_code == 503
    urgent = arrival("urgent_0", 5)
    assert core.core.queue_error(urgent) is None and core.core.queue_victim(urgent) is low_new
    plain = make_core(max_running_requests=1, max_queued_requests=1)
    plain.add("a_0", 4)
    assert plain.core.queue_victim(urgent) is None and plain.core.queue_error(urgent).status_code == 503
    assert low_old in core.planner.waiting


def test_a_priority_without_priority_scheduling_is_ignored_or_a_503_as_sglang():
    """SGLang's _set_or_validate_priority: without --enable-priority-scheduling a request's priority
    is ignored, unless --abort-on-priority-when-disabled, which ends it with a 503 (a request that
    names none still runs; with priority scheduling on, the flag changes nothing)."""
    def arrival(priority: int | None) -> Req:
        msg = TokenizedGenerateReq(rid="r_0", input_ids=np.arange(500, 504, dtype=np.int32), stream=False,
                                   sampling_params=SamplingParams(max_new_tokens=2), priority=priority)
        return Req.from_message(msg, 1, 0)

    assert make_core().core.admission_error(arrival(3)) is None
    strict = make_core(abort_on_priority_when_disabled=True).core
    error = strict.admission_error(arrival(3))
    assert (error.type, error.status_code) == ("abort", 503)
    assert error.message == ("Using priority is disabled for this server. "
                             "Please send a new request without a priority.")
    assert strict.admission_error(arrival(None)) is None
    enabled = make_core(abort_on_priority_when_disabled=True, enable_priority_scheduling=True).core
    assert enabled.admission_error(arrival(3)) is None


def test_preemption_counts_only_the_memory_a_victim_frees():
    """A victim sharing its prompt with a request that keeps running frees only its own slots: when
    that is not enough the arrival waits and nobody is retracted (the victim was retracted for
    nothing, counted as if it freed the shared prompt); n>1 siblings that all give way free it."""
    prompt = list(range(1000, 1045))
    core = make_core(max_total_tokens=100, max_running_requests=2, enable_priority_scheduling=True,
                     priority_preemption=True)
    kept, victim = core.add("kept_0", prompt, max_new_tokens=6, priority=45), core.add("v_0", prompt, max_new_tokens=6)
    core.process(core.plan())
    core.add("h_0", list(range(2000, 2060)), max_new_tokens=2, priority=50)  # 5 above kept: only v gives way
    batch = core.plan()
    assert batch.mode == ForwardMode.DECODE and victim.retract_count == 0
    assert {kept.rid, victim.rid} == {r.rid for r in core.planner.running}
    core.process(batch)
    core.run()
    core.assert_no_leaks()
    core = make_core(max_total_tokens=100, max_running_requests=2, enable_priority_scheduling=True,
                     priority_preemption=True)
    siblings = [core.add(f"a_{i}", prompt, max_new_tokens=6, priority=0) for i in range(2)]
    core.process(core.plan())
    core.add("h_0", list(range(2000, 2060)), max_new_tokens=2, priority=50)
    batch = core.plan()
    assert [s.req.rid for s in batch.spans] == ["h_0"] and all(s.retract_count == 1 for s in siblings)
    core.process(batch)
    core.run()
    core.assert_no_leaks()

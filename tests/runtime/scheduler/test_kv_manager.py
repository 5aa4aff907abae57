"""KVManager without processes: decode slots taken in runs, leak_report and the scheduler's idle
memory check built on it."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tandem.runtime.cache.pools import DECODE_SLOT_RUN
from tandem.runtime.scheduler.scheduler import Scheduler
from tests.runtime.scheduler.fake_worker import fake_token, make_core


def _decode_slots(core, steps: int) -> dict[str, list[int]]:
    """Run the prefill and `steps` decode steps; each request's slot per decode position."""
    core.process(core.plan())
    slots: dict[str, list[int]] = {}
    for _ in range(steps):
        batch = core.plan()
        for span in batch.spans:
            slots.setdefault(span.req.rid, []).extend(span.out_cache_loc.tolist())
        core.process(batch)
    return slots


def test_decode_slots_of_a_request_are_contiguous_runs():
    core = make_core(max_total_tokens=512, radix=False)
    reqs = [core.add(rid, 6, max_new_tokens=60) for rid in "abc"]
    slots = _decode_slots(core, 2 * DECODE_SLOT_RUN + 1)
    for req in reqs:
        own = slots[req.rid]
        runs = [own[i:i + DECODE_SLOT_RUN] for i in range(0, 2 * DECODE_SLOT_RUN, DECODE_SLOT_RUN)]
        assert all(run == list(range(run[0], run[0] + DECODE_SLOT_RUN)) for run in runs)
        # the third run's first slot is in use; the rest sits in the row beyond the committed positions
        assert req.kv.alloc_len == req.kv.committed_len + DECODE_SLOT_RUN - 1
    core.run()
    for req in reqs:
        assert req.output_ids == [fake_token(p) for p in range(6, 66)]
    assert core.kv.leak_report() is None  # what was reserved and never used went back


def test_a_run_never_reaches_past_the_last_position_a_request_computes():
    core = make_core(max_total_tokens=512, radix=False)
    req = core.add("short", 6, max_new_tokens=4)  # decodes positions 6, 7 and 8
    core.process(core.plan())
    free_before = core.kv.allocator.available_size()
    core.plan()
    assert req.kv.alloc_len == 9 and core.kv.allocator.available_size() == free_before - 3


def test_short_memory_drops_reserved_runs_before_retracting_anyone():
    core = make_core(max_total_tokens=64, radix=False)
    a = core.add("a", 4, max_new_tokens=40)
    core.process(core.plan())
    core.process(core.plan())  # a decodes once and holds the rest of its run
    assert a.kv.alloc_len - a.kv.committed_len == DECODE_SLOT_RUN - 1
    b = core.add("b", 4, max_new_tokens=40)
    core.process(core.plan())  # b's prefill: b has no decode slot yet
    hog = core.kv.allocator.alloc(core.kv.available_tokens())  # memory held by something else
    batch = core.plan()  # b needs a slot and none is free: a's reserved run goes, nobody is retracted
    assert [s.req.rid for s in batch.spans] == ["a", "b"] and core.planner.num_retractions == 0
    assert a.kv.alloc_len == a.kv.committed_len and b.kv.alloc_len == b.kv.committed_len  # one slot each
    core.process(batch)
    assert core.kv.drop_decode_runs([a, b]) is False
    more = core.kv.allocator.alloc(core.kv.available_tokens())  # what a's run gave back, taken too
    core.process(core.plan())  # nothing reserved left to drop: the newest is retracted
    assert core.planner.num_retractions == 1 and core.planner.waiting == [b]
    core.kv.allocator.free(hog)
    core.kv.allocator.free(more)
    core.run()
    assert a.output_ids == b.output_ids == [fake_token(p) for p in range(4, 44)]
    assert core.kv.leak_report() is None


def test_no_leak_after_requests_finish_and_abort():
    core = make_core()
    for i in range(3):
        core.add(f"r{i}", 12, max_new_tokens=5)
    core.run()
    core.add("shared", [10, 11, 12, 13, 50], max_new_tokens=3)  # a cache hit, then released
    core.add("gone", 8, max_new_tokens=50)
    core.run()
    core.add("gone", 8, max_new_tokens=50)
    core.process(core.plan())  # "gone" holds KV and a row now
    assert core.kv.leak_report() is not None
    assert [r.rid for r in core.abort("gone")] == ["gone"]
    assert core.kv.leak_report() is None


def test_a_request_that_keeps_its_kv_is_reported():
    core = make_core()
    core.add("kept", 12, max_new_tokens=5)
    core.run()
    req = core.add("holder", [10, 11, 12, 13, 99], max_new_tokens=3)
    prefix, node = core.kv.match_prefix(req)
    assert core.kv.start(req, prefix, node) and core.kv.extend(req, 1) is not None
    core.planner.waiting.remove(req)  # dropped by a buggy path without kv.release
    report = core.kv.leak_report()
    assert report is not None and "4 locked" in report and "request rows: 8 free of 9" in report


def test_a_slot_nobody_owns_is_reported():
    core = make_core(max_total_tokens=64)
    core.kv.allocator.alloc(3)
    assert core.kv.leak_report() == "KV slots: 61 free + 0 cached of 64, 0 locked, 0 in the tree"


def _idle_scheduler(leak: str | None) -> SimpleNamespace:
    return SimpleNamespace(kv=SimpleNamespace(leak_report=lambda: leak))


def test_idle_check_raises_in_strict_mode(monkeypatch):
    monkeypatch.setenv("TANDEM_STRICT_MEM_CHECK", "1")
    Scheduler._check_memory(_idle_scheduler(None))
    with pytest.raises(RuntimeError, match="KV memory leak detected with no request running: KV slots"):
        Scheduler._check_memory(_idle_scheduler("KV slots: 1 free"))


def test_idle_check_logs_an_error_otherwise(monkeypatch, caplog):
    monkeypatch.delenv("TANDEM_STRICT_MEM_CHECK", raising=False)
    with caplog.at_level(logging.ERROR, logger="tandem.scheduler"):
        Scheduler._check_memory(_idle_scheduler("request rows: 3 free of 4"))
    assert "leak detected" in caplog.text and "request rows: 3 free of 4" in caplog.text

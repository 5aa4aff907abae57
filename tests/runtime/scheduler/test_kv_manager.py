"""KVManager.leak_report and the scheduler's idle memory check built on it."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tandem.runtime.scheduler.scheduler import Scheduler
from tests.scheduler_core import make_core


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

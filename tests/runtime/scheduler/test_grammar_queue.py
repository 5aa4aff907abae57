"""GrammarQueue: constrained requests wait for their grammar off the planner's queue; compile
errors and timeouts are a 400 quoting xgrammar; aborts reach requests still compiling."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from tandem.ipc.messages import TokenizedGenerateReq
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.scheduler.grammar_queue import GrammarQueue
from tandem.runtime.scheduler.request import Req


class FakeBackend:
    """Compiles nothing: the test decides when each future resolves."""

    def __init__(self) -> None:
        self.futures: dict[tuple[str, str], Future] = {}
        self.released: list[tuple[str, str]] = []

    def compile(self, kind: str, text: str) -> Future:
        return self.futures.setdefault((kind, text), Future())

    def matcher(self, compiled: object) -> str:
        return f"matcher of {compiled}"

    def release(self, kind: str, text: str) -> None:
        self.released.append((kind, text))

    @staticmethod
    def error_message(exc: BaseException) -> str:
        return str(exc)


def _req(rid: str, require_reasoning: bool = False, **constraint) -> Req:
    msg = TokenizedGenerateReq(rid=rid, input_ids=np.array([1, 2], np.int32), stream=False,
                               sampling_params=SamplingParams(**constraint), require_reasoning=require_reasoning)
    return Req.from_message(msg, 1, default_seed=1)


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The queue's clock, moved by the test: a pause of the test machine cannot time a compile out."""
    from tandem.runtime.scheduler import grammar_queue

    now = [100.0]
    monkeypatch.setattr(grammar_queue, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_ready_failed_and_timed_out(clock):
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout_s=0.2)  # type: ignore[arg-type]
    ok, bad, slow = _req("a_0", regex="a+"), _req("b_0", regex="("), _req("c_0", ebnf="root ::= x")
    for r in (ok, bad, slow):
        queue.add(r)
    assert queue.poll() == ([], []) and len(queue) == 3
    backend.futures[("regex", "a+")].set_result("G")
    backend.futures[("regex", "(")].set_exception(RuntimeError("parenthesis is not closed"))
    ready, failed = queue.poll()
    assert ready == [ok] and ok.grammar == "matcher of G"
    assert [(r, f.status_code) for r, f in failed] == [(bad, 400)]
    assert (failed[0][1].field, failed[0][1].message) == ("sampling_params.regex",
                                                           "does not compile: parenthesis is not closed")
    clock[0] += 0.25
    ready, failed = queue.poll()
    assert ready == [] and failed[0][0] is slow and failed[0][1].field == "sampling_params.ebnf"
    assert "--grammar-compile-timeout (0.2 s)" in failed[0][1].message
    assert len(queue) == 0


def test_requests_sharing_a_grammar_get_a_matcher_each_from_one_compile():
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout_s=10)  # type: ignore[arg-type]
    plain, reasoning = _req("a_0", regex="x"), _req("b_0", require_reasoning=True, regex="x")
    queue.add(plain)
    queue.add(reasoning)
    backend.futures[("regex", "x")].set_result("G")
    assert queue.poll() == ([plain, reasoning], [])
    assert (plain.grammar, reasoning.grammar) == ("matcher of G", "matcher of G")


def test_abort_reaches_requests_still_compiling():
    queue = GrammarQueue(FakeBackend(), timeout_s=10)  # type: ignore[arg-type]
    a, b = _req("g1_0", regex="x"), _req("g2_0", regex="x")
    queue.add(a)
    queue.add(b)
    assert queue.take(["g2_"], abort_all=False) == [b] and len(queue) == 1
    assert queue.take([], abort_all=True) == [a] and len(queue) == 0


def test_a_grammar_nobody_waits_for_any_more_is_released(clock):
    """Aborted or timed out, the last request waiting for a grammar lets the backend cancel a
    compile that has not started (SGLang cancels it): abandoned grammars must not hold the pool
    from the ones requests still wait for. One another request still waits for is kept."""
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout_s=1.0)  # type: ignore[arg-type]
    a, b, c = _req("g1_0", regex="x"), _req("g2_0", regex="x"), _req("g3_0", ebnf="root ::= y")
    for r in (a, b, c):
        queue.add(r)
    queue.take(["g1_"], abort_all=False)
    assert backend.released == []  # g2 still waits for "x"
    queue.take(["g2_"], abort_all=False)
    assert backend.released == [("regex", "x")]
    clock[0] += 2
    assert [r for r, _ in queue.poll()[1]] == [c] and backend.released[-1] == ("ebnf", "root ::= y")


def test_another_tp_rank_settles_what_rank0_settled(clock):
    """Under TP rank 0 decides who leaves the queue: a compile rank 0 saw finish is waited for here
    (this rank compiles slower), one rank 0 timed out fails here though it compiled, and one rank 0
    did not name stays, compiled or not: every rank admits the same requests in the same order."""
    backend = FakeBackend()
    queue = GrammarQueue(backend, timeout_s=1.0)  # type: ignore[arg-type]
    slow_here, timed_out, not_named = _req("a_0", regex="a"), _req("b_0", regex="b"), _req("c_0", regex="c")
    for r in (slow_here, timed_out, not_named):
        queue.add(r)
    backend.futures[("regex", "b")].set_result("B")
    backend.futures[("regex", "c")].set_result("C")
    threading.Timer(0.2, backend.futures[("regex", "a")].set_result, ["A"]).start()
    ready, failed = queue.settle(["a_0", "gone_0"], ["b_0"])
    assert ready == [slow_here] and slow_here.grammar == "matcher of A"
    assert [r for r, _ in failed] == [timed_out] and "--grammar-compile-timeout" in failed[0][1].message
    assert len(queue) == 1 and queue.settled() == (["c_0"], [])

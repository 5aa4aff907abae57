"""CompilePool: a bounded number of compiles at once, on threads at the lowest OS priority; a
compile nobody waits for gives its place to the next at once, and its result is dropped."""
from __future__ import annotations

import os
import threading
import time

import pytest

from tandem.runtime.grammar.compile_pool import Abandoned, CompilePool


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_compiles_run_niced_and_at_most_threads_at_once():
    pool = CompilePool(2)
    gate = threading.Event()
    started: list[int] = []
    lock = threading.Lock()

    def compile_(i: int) -> tuple[int, int]:
        with lock:
            started.append(i)
        gate.wait(30)
        return i, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    futs = [pool.submit(compile_, i) for i in range(5)]
    _wait_for(lambda: len(started) == 2)
    time.sleep(0.05)
    assert len(started) == 2 and pool.busy() == (2, 0, 3)
    gate.set()
    results = [f.result(timeout=10) for f in futs]
    assert [i for i, _ in results] == list(range(5))
    assert all(nice == 19 for _, nice in results)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0  # the caller's thread is untouched
    pool.close()


def test_an_abandoned_compile_frees_its_place_at_once_and_its_result_is_dropped():
    pool = CompilePool(1)
    gates = [threading.Event() for _ in range(3)]
    stuck = pool.submit(gates[0].wait, 30)
    queued = pool.submit(lambda: "next")
    _wait_for(lambda: pool.busy() == (1, 0, 1))
    assert pool.abandon(stuck)
    assert queued.result(timeout=10) == "next"  # while the stuck compile's thread still runs
    with pytest.raises(Abandoned):
        stuck.result(timeout=0)
    assert pool.busy() == (0, 1, 0)
    gates[0].set()
    _wait_for(lambda: pool.busy() == (0, 0, 0))
    assert stuck.exception(timeout=0).__class__ is Abandoned  # its late result went nowhere
    pool.close()


def test_abandoned_compiles_still_running_are_bounded():
    """Up to max_abandoned given-up compiles may still run; past that, new compiles wait for one
    to end, so a stream of given-up schemas cannot pile up threads."""
    assert CompilePool(2).max_abandoned == 8
    pool = CompilePool(1, max_abandoned=1)
    gate = threading.Event()
    first = pool.submit(gate.wait, 30)
    _wait_for(lambda: pool.busy()[0] == 1)
    pool.abandon(first)
    second = pool.submit(lambda: "second")
    time.sleep(0.05)
    assert not second.done() and pool.busy() == (0, 1, 1)
    gate.set()
    assert second.result(timeout=10) == "second"
    pool.close()


def test_abandoning_a_queued_compile_cancels_it_and_a_finished_one_stays():
    pool = CompilePool(1)
    gate = threading.Event()
    running = pool.submit(gate.wait, 30)
    queued = pool.submit(lambda: "never")
    assert pool.abandon(queued) and queued.cancelled()
    gate.set()
    assert running.result(timeout=10) is True
    assert not pool.abandon(running)  # done: nothing to give up
    failing = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    pool.close()

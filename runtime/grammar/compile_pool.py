"""CompilePool: grammar compiles off the scheduler thread, never at the forward's expense.

At most `threads` compiles run at once (`--grammar-compile-threads`, 1 by default), each on its
own thread at the lowest OS priority (nice 19), so on a machine whose cores the forward's
intra-op threads already fill, a compile runs on what they leave: sixteen 300 KB schemas on a
pool of cores + 4 threads at normal priority took a 4-token request from 0.15 s to 9.2 s.

xgrammar cannot stop a compile it has started. `abandon` (a timed-out or aborted request, the
last one waiting for it) frees the compile's place at once: the next compile starts, and the
abandoned one finishes on its niced thread with nobody waiting and its result dropped. At most
`max_abandoned` (4 per thread) abandoned compiles run at a time; past that, new compiles wait
for one to end, so a stream of abandoned schemas cannot pile up threads and memory.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

COMPILE_NICE = 19


class Abandoned(Exception):
    """The compile's result was given up on (no request waits for it any more)."""


class CompilePool:
    def __init__(self, threads: int, nice: int = COMPILE_NICE, max_abandoned: int | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self.max_abandoned = 4 * threads if max_abandoned is None else max_abandoned
        self._nice = nice
        self._lock = threading.RLock()  # a done-callback may submit again
        self._queued: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._running: set[Future] = set()
        self._abandoned = 0  # abandoned compiles whose thread still runs
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            self._queued.append((fut, fn, args))
            self._start_queued()
        return fut

    def abandon(self, fut: Future) -> bool:
        """No one waits for `fut`: a queued compile is cancelled, a running one resolves to
        `Abandoned` and its place goes to the next. False when it had already finished."""
        with self._lock:
            if fut.cancel():
                return True
            if fut not in self._running:
                return False
            self._running.discard(fut)
            self._abandoned += 1
            fut.set_exception(Abandoned())
            self._start_queued()
            return True

    def busy(self) -> tuple[int, int, int]:
        """(running, abandoned still running, queued) compiles."""
        with self._lock:
            return len(self._running), self._abandoned, len(self._queued)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for fut, _, _ in self._queued:
                fut.cancel()
            self._queued.clear()

    def _start_queued(self) -> None:
        while (self._queued and not self._closed and len(self._running) < self.threads
               and self._abandoned < self.max_abandoned):
            fut, fn, args = self._queued.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            self._running.add(fut)
            threading.Thread(target=self._run, args=(fut, fn, args), name="tandem-grammar", daemon=True).start()

    def _run(self, fut: Future, fn: Callable[..., Any], args: tuple) -> None:
        _lower_priority(self._nice)
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # the compile's error is the request's 400
            result, error = None, exc
        with self._lock:
            if fut in self._running:
                self._running.discard(fut)
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)
            else:
                self._abandoned -= 1
            self._start_queued()


def _lower_priority(nice: int) -> None:
    """This thread only (Linux: a thread id is a process id to setpriority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux: the thread runs at the process's priority
        pass

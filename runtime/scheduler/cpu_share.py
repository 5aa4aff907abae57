"""CpuShare: how many intra-op threads the forward may use while other processes take cores.

OpenMP teams spin at their barriers and wait for their slowest thread. When another process takes
one of the cores the team runs on, every parallel region (dozens a decode step) waits for the
thread the kernel has descheduled. The worker asks `threads()` before each step
and runs with one thread fewer for every core the rest of the machine keeps busy, back to all of
them once those cores are free again. Results do not depend on it: every CPU op tandem runs splits
its work by rows, never by the reduction (tests/runtime/model/test_thread_invariance.py).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

CHECK_INTERVAL_S = 1.0
# cores the other processes must keep busy, on average over an interval, to take one thread away;
# below it (the server's own HTTP and detokenizer processes at a busy moment) all threads stay
BUSY_CORE = 0.75


def machine_busy_s() -> float | None:
    """CPU seconds every process of the machine has run (user, nice, system, irq), or None where
    /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_busy_s() -> float:
    times = os.times()
    return times.user + times.system


class CpuShare:
    def __init__(self, max_threads: int, clock: Callable[[], float] = time.monotonic,
                 machine: Callable[[], float | None] = machine_busy_s, own: Callable[[], float] = own_busy_s) -> None:
        self.max_threads = max_threads
        self._clock, self._machine, self._own = clock, machine, own
        self._threads = max_threads
        self._last = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._machine(), self._own()

    def threads(self) -> int:
        """The thread count for the next step: `max_threads` less one per core that other
        processes kept busy over the last interval, at least one. Reads /proc at most once a
        CHECK_INTERVAL_S."""
        if self.max_threads <= 1:
            return self.max_threads
        now = self._clock()
        t0, machine0, own0 = self._last
        if now - t0 < CHECK_INTERVAL_S:
            return self._threads
        self._last = sample = self._sample()
        if machine0 is None or sample[1] is None:
            return self._threads
        others = max(0.0, (sample[1] - machine0) - (sample[2] - own0)) / (sample[0] - t0)
        taken = int(others + 1 - BUSY_CORE)  # 0.75 busy cores take one thread, 1.75 two
        self._threads = max(1, self.max_threads - taken)
        return self._threads

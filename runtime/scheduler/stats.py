"""StepStats: scheduler CPU time per step, device busy/idle time, and SGLang-style batch log lines.

Device idle time counts only gaps while the scheduler had work (a job flagged
`follows_busy_step`); gaps after the server went quiet are not idling.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque

logger = logging.getLogger("tandem.scheduler")
_LOG_EVERY_STEPS = 40


class StepStats:
    def __init__(self) -> None:
        self._step_times: deque[float] = deque(maxlen=2000)
        self.num_steps = 0
        self._gen_tokens = 0
        self._last_log = time.perf_counter()
        self._lock = threading.Lock()  # the device side is written by the forward worker thread
        self._busy_s = 0.0
        self._idle_s = 0.0
        self._last_device_end: float | None = None

    # -- recording ---------------------------------------------------------------------------------
    def record_step(self, cpu_s: float) -> None:
        """CPU time of one scheduler iteration that planned a step, waits for the device excluded."""
        self._step_times.append(cpu_s)
        self.num_steps += 1

    def count_generated(self, n: int) -> None:
        self._gen_tokens += n

    def record_device(self, start: float, end: float, follows_busy_step: bool) -> None:
        with self._lock:
            if follows_busy_step and self._last_device_end is not None:
                self._idle_s += start - self._last_device_end
            self._busy_s += end - start
            self._last_device_end = end

    # -- reading --------------------------------------------------------------------------------------
    def idle_fraction(self) -> float:
        """Share of time the device waited for the next step while the scheduler had work."""
        with self._lock:
            total = self._busy_s + self._idle_s
            return self._idle_s / total if total > 0 else 0.0

    def step_ms(self) -> tuple[float, float]:
        """Median and p99 scheduler CPU time per step, in ms."""
        times = sorted(self._step_times)
        if not times:
            return 0.0, 0.0
        p99 = times[min(int(len(times) * 0.99), len(times) - 1)]
        return round(statistics.median(times) * 1e3, 3), round(p99 * 1e3, 3)

    def info(self) -> dict[str, float | int]:
        median, p99 = self.step_ms()
        with self._lock:
            busy, idle = self._busy_s, self._idle_s
        return {"device_idle_fraction": round(self.idle_fraction(), 4), "device_busy_s": round(busy, 4),
                "device_idle_s": round(idle, 4), "step_time_median_ms": median, "step_time_p99_ms": p99,
                "num_steps": self.num_steps}

    # -- logging ----------------------------------------------------------------------------------------
    def log_prefill(self, new_seqs: int, new_tokens: int, cached_tokens: int, usage: float, running: int,
                    queued: int) -> None:
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                    "#running-req: %d, #queue-req: %d", new_seqs, new_tokens, cached_tokens, usage, running, queued)

    def maybe_log_decode(self, running: int, used_tokens: int, usage: float, queued: int, overlap: bool) -> None:
        """Every 40th step: the decode line with throughput since the previous line."""
        if self.num_steps % _LOG_EVERY_STEPS:
            return
        now = time.perf_counter()
        rate = self._gen_tokens / max(now - self._last_log, 1e-9)
        self._gen_tokens, self._last_log = 0, now
        median, p99 = self.step_ms()
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                    "#queue-req: %d, overlap: %s, device idle: %.1f%%, step (median/p99 ms): %.2f/%.2f",
                    running, used_tokens, usage, rate, queued, overlap, 100 * self.idle_fraction(), median, p99)

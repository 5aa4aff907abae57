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
_THROUGHPUT_WINDOW_S = 10.0


class StepStats:
    def __init__(self) -> None:
        self._step_times: deque[float] = deque(maxlen=2000)
        self.num_steps = 0  # processed: every output of a step counted here has been streamed
        self._decode_steps = 0  # planned decode steps, for the log's cadence
        self._gen_tokens = 0
        self._last_log = time.perf_counter()
        self._lock = threading.Lock()  # the device side is written by the forward worker thread
        self._busy_s = 0.0
        self._idle_s = 0.0
        self._last_device_end: float | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of steps in the last window
        self._grammar_fill: deque[float] = deque(maxlen=2000)  # seconds per constrained row, per step
        # speculative decoding since start: request-verifies, tokens they kept, drafts checked / accepted
        self._spec_verifies = self._spec_tokens = self._spec_drafts = self._spec_accepted = 0
        self.intra_op_threads: int | None = None  # the forward's current count, once CpuShare changed it

    # -- recording ---------------------------------------------------------------------------------
    def record_step(self, cpu_s: float) -> None:
        """CPU time of one scheduler iteration that planned a step, waits for the device excluded."""
        self._step_times.append(cpu_s)

    def count_generated(self, n: int) -> None:
        """One processed step (its results applied) and the tokens it generated."""
        self.num_steps += 1
        self._gen_tokens += n
        now = time.monotonic()
        self._recent.append((now, n))
        while self._recent and now - self._recent[0][0] > _THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def gen_throughput(self) -> float:
        """Generated tokens per second over the steps of the last window, kept while the server
        is idle (SGLang's last_gen_throughput holds until the next decode log): the tokens after
        the window's first step over the time since it, so a burst shorter than the window is
        not diluted by it. 0 until two steps have run."""
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        tokens = sum(n for _, n in self._recent) - self._recent[0][1]
        return tokens / span if span > 0 else 0.0

    def record_verify(self, num_drafts: list[int], runs: list[list[int]]) -> None:
        """One verify pass: drafts checked and tokens kept per request (before finish trimming)."""
        self._spec_verifies += len(runs)
        self._spec_tokens += sum(map(len, runs))
        self._spec_drafts += sum(num_drafts)
        self._spec_accepted += sum(map(len, runs)) - len(runs)

    def record_grammar_fill(self, seconds: float, rows: int) -> None:
        """Filling one step's grammar mask on the CPU (off the device's critical path under overlap)."""
        if rows:
            self._grammar_fill.append(seconds / rows)

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
                "num_steps": self.num_steps, "gen_throughput": round(self.gen_throughput(), 3),
                "grammar_mask_us_per_row": round(statistics.median(self._grammar_fill) * 1e6, 2)
                if self._grammar_fill else None,
                **({"intra_op_threads": self.intra_op_threads} if self.intra_op_threads is not None else {}),
                **self._spec_info()}

    def _spec_info(self) -> dict[str, float]:
        if not self._spec_verifies:
            return {}
        return {"avg_spec_accept_length": round(self._spec_tokens / self._spec_verifies, 4),
                "spec_accept_rate": round(self._spec_accepted / self._spec_drafts, 4) if self._spec_drafts else 0.0,
                "spec_verify_ct": self._spec_verifies}

    # -- logging ----------------------------------------------------------------------------------------
    def log_prefill(self, new_seqs: int, new_tokens: int, cached_tokens: int, usage: float, running: int,
                    queued: int) -> None:
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                    "#running-req: %d, #queue-req: %d", new_seqs, new_tokens, cached_tokens, usage, running, queued)

    def maybe_log_decode(self, running: int, used_tokens: int, usage: float, queued: int, overlap: bool) -> None:
        """Every 40th decode step (SGLang's decode_log_interval): the decode line with throughput
        since the previous line."""
        self._decode_steps += 1
        if self._decode_steps % _LOG_EVERY_STEPS:
            return
        now = time.perf_counter()
        rate = self._gen_tokens / max(now - self._last_log, 1e-9)
        self._gen_tokens, self._last_log = 0, now
        median, p99 = self.step_ms()
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                    "#queue-req: %d, overlap: %s, device idle: %.1f%%, step (median/p99 ms): %.2f/%.2f",
                    running, used_tokens, usage, rate, queued, overlap, 100 * self.idle_fraction(), median, p99)

"""ReqRows: the lifecycle of request rows (ReqToTokenPool rows) and of the per-row device state.

Invariant: a released row is handed out again only after every step launched before its
release has been processed. A step in flight may still read the row's KV table and write the
row's future-map entries and penalty counts; the scheduler thread, meanwhile, writes the table
row of whichever request gets the row next. Per-row device state is reset here and nowhere else:
penalty counts when a row is handed to a request (from that request's output so far, so a
retracted request resumes its counts), future-map entries poisoned (debug mode) when the row
is freed.
"""
from __future__ import annotations

from tandem.runtime.cache.pools import ReqToTokenPool
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.sampling.penalties import PenaltyCounts
from tandem.runtime.scheduler.future_map import FutureMap


class ReqRows:
    def __init__(self, pool: ReqToTokenPool, future_map: FutureMap, penalty_counts: PenaltyCounts) -> None:
        self.pool = pool
        self.future_map = future_map
        self.penalty_counts = penalty_counts
        self._launched = 0  # id of the latest launched step
        self._processed = 0  # id of the latest processed step (steps are processed in order)
        self._released: list[tuple[int, int]] = []  # (row, latest step launched when it was released)

    @property
    def size(self) -> int:
        return self.pool.size

    @property
    def step_in_flight(self) -> bool:
        return self._processed < self._launched

    def available(self) -> int:
        """Rows free now (released rows still waiting for their steps do not count)."""
        return self.pool.available_size()

    def num_deferred(self) -> int:
        return len(self._released)

    # -- a request's row ----------------------------------------------------------------------
    def alloc(self, sampling_params: SamplingParams, output_ids: list[int]) -> int | None:
        row = self.pool.alloc()
        if row is not None and sampling_params.has_penalties:
            self.penalty_counts.reset_row(row, output_ids)
        return row

    def release(self, row: int) -> None:
        if self.step_in_flight:
            self._released.append((row, self._launched))
        else:
            self._free(row)

    # -- step bookkeeping ----------------------------------------------------------------------
    def on_launch(self) -> int:
        """A step is being launched; returns its id."""
        self._launched += 1
        return self._launched

    def on_processed(self, step_id: int) -> None:
        """Step `step_id` (and so every earlier one) has been processed: free what waited for it."""
        self._processed = step_id
        ready = [row for row, step in self._released if step <= step_id]
        self._released = [(row, step) for row, step in self._released if step > step_id]
        for row in ready:
            self._free(row)

    def reset(self) -> None:
        """Every row free again (cache flush); only legal with no step in flight."""
        if self.step_in_flight:
            raise RuntimeError("request rows reset while a step is in flight")
        self._released = []
        self.pool.clear()
        self.future_map.poison(list(range(self.pool.size)))

    def _free(self, row: int) -> None:
        self.pool.free(row)
        self.future_map.poison([row])

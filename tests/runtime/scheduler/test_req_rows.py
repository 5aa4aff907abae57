"""ReqRows: deferred reuse of released rows, future-map poisoning when a row is freed, penalty
counts reset when a row is handed out, and flush only with no step in flight."""
from __future__ import annotations

import pytest
import torch

from tandem.runtime.cache.pools import ReqToTokenPool
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.sampling.penalties import PenaltyCounts
from tandem.runtime.scheduler.future_map import POISON, FutureMap, RelayPayload
from tandem.runtime.scheduler.req_rows import ReqRows

PLAIN = SamplingParams()
PENALIZED = SamplingParams(frequency_penalty=1.0)


def _rows(size: int = 3) -> ReqRows:
    pool = ReqToTokenPool(size, 16)
    return ReqRows(pool, FutureMap(size, "cpu", debug=True), PenaltyCounts(size, 32))


def test_a_row_released_during_a_step_is_reused_only_after_that_step_was_processed():
    rows = _rows(size=2)
    a = rows.alloc(PLAIN, [])
    b = rows.alloc(PLAIN, [])
    assert rows.alloc(PLAIN, []) is None
    step1 = rows.on_launch()
    rows.release(a)  # step 1 may still read row a
    assert rows.available() == 0 and rows.num_deferred() == 1 and rows.alloc(PLAIN, []) is None
    step2 = rows.on_launch()
    rows.release(b)  # released after step 2 launched: waits for step 2
    rows.on_processed(step1)
    assert rows.available() == 1 and rows.alloc(PLAIN, []) == a
    assert rows.num_deferred() == 1
    rows.on_processed(step2)
    assert rows.available() == 1 and rows.num_deferred() == 0


def test_with_nothing_in_flight_a_row_is_freed_at_once():
    rows = _rows()
    r = rows.alloc(PLAIN, [])
    rows.on_processed(rows.on_launch())
    rows.release(r)
    assert rows.available() == 3


def test_freed_rows_are_poisoned_in_the_future_map():
    rows = _rows()
    r = rows.alloc(PLAIN, [])
    fm = rows.future_map
    fm.stash(RelayPayload(rows=torch.tensor([r]), bonus_tokens=torch.tensor([42])))
    step = rows.on_launch()
    rows.release(r)
    assert fm.bonus[r] == 42  # the step in flight may still gather it
    rows.on_processed(step)
    assert fm.bonus[r] == POISON
    with pytest.raises(RuntimeError, match="gathered before a step wrote it"):
        fm.gather_bonus(torch.tensor([r]))


def test_penalty_counts_are_reset_from_the_output_so_far_when_a_row_is_handed_out():
    rows = _rows()
    counts = rows.penalty_counts
    r = rows.alloc(PENALIZED, [5, 5, 7])
    assert counts.counts[r, 5] == 2 and counts.counts[r, 7] == 1
    counts.add(torch.tensor([r]), torch.tensor([9]))
    rows.release(r)
    again = rows.alloc(PENALIZED, [1])  # the same row, another request: nothing may leak over
    assert again == r and counts.counts[r].sum() == 1 and counts.counts[r, 1] == 1
    other = rows.alloc(PLAIN, [3])  # no count-based penalty: its row is never read, never reset
    assert counts.counts[other].sum() == 0


def test_reset_refuses_while_a_step_is_in_flight():
    rows = _rows()
    rows.alloc(PLAIN, [])
    step = rows.on_launch()
    with pytest.raises(RuntimeError, match="in flight"):
        rows.reset()
    rows.on_processed(step)
    rows.reset()
    assert rows.available() == 3

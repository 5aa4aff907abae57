"""FutureMap: stash and gather by pool row; debug mode catches a gather nobody wrote, a stale
read of a freed row, and a second read of one stash."""
from __future__ import annotations

import pytest
import torch

from tandem.runtime.scheduler.future_map import FutureMap, RelayPayload


def test_stash_then_gather_by_row():
    fm = FutureMap(8, "cpu")
    fm.stash(RelayPayload(rows=torch.tensor([5, 2]), bonus_tokens=torch.tensor([50, 20])))
    assert fm.gather_bonus(torch.tensor([2, 5, 2])).tolist() == [20, 50, 20]
    fm.stash(None)  # a middle prefill chunk sampled nothing
    fm.stash(RelayPayload(rows=torch.tensor([2]), bonus_tokens=torch.tensor([21])))
    assert fm.gather_bonus(torch.tensor([5, 2])).tolist() == [50, 21]


def test_debug_catches_unwritten_poisoned_and_reread_entries():
    fm = FutureMap(8, "cpu", debug=True)
    fm.stash(RelayPayload(rows=torch.tensor([1, 2]), bonus_tokens=torch.tensor([7, 8])))
    assert fm.gather_bonus(torch.tensor([1])).tolist() == [7]
    with pytest.raises(RuntimeError, match="bonus token gathered before a step wrote it"):
        fm.gather_bonus(torch.tensor([1]))  # consumed on read: a second gather needs a new stash
    with pytest.raises(RuntimeError, match="bonus token gathered before a step wrote it"):
        fm.gather_bonus(torch.tensor([3]))  # never written
    fm.poison([2])  # the request on row 2 left; a later step must not read its token
    with pytest.raises(RuntimeError, match="bonus token gathered before a step wrote it"):
        fm.gather_bonus(torch.tensor([2]))
    fm.stash(RelayPayload(rows=torch.tensor([2]), bonus_tokens=torch.tensor([9])))
    assert fm.gather_bonus(torch.tensor([2])).tolist() == [9]


def test_multi_token_speculative_payload():
    fm = FutureMap(4, "cpu", max_draft_tokens=3, debug=True)
    payload = RelayPayload(rows=torch.tensor([0, 3]), bonus_tokens=torch.tensor([7, 8]),
                           seq_lens=torch.tensor([10, 20]), draft_tokens=torch.tensor([[1, 2, 3], [4, 5, 6]]),
                           draft_lens=torch.tensor([2, 3]))
    assert payload.is_speculative
    fm.stash(payload)
    drafts, lens, seq_lens = fm.gather_draft(torch.tensor([3, 0]), 3)
    assert drafts.tolist() == [[4, 5, 6], [1, 2, 3]] and lens.tolist() == [3, 2] and seq_lens.tolist() == [20, 10]
    with pytest.raises(RuntimeError, match="gathered before a step wrote it"):
        fm.gather_draft(torch.tensor([1]), 3)  # never written
    with pytest.raises(RuntimeError, match="gathered before a step wrote it"):
        fm.gather_draft(torch.tensor([0]), 3)  # consumed by the first read

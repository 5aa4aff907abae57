"""FutureMap: stash and gather by pool row; the debug poison catches a gather nobody wrote."""
from __future__ import annotations

import pytest
import torch

from tandem.runtime.scheduler.future_map import FutureMap, FutureMapError, RelayPayload


def test_stash_then_gather_by_row():
    fm = FutureMap(8, "cpu")
    fm.stash(RelayPayload(rows=torch.tensor([5, 2]), bonus_tokens=torch.tensor([50, 20])))
    assert fm.gather_bonus(torch.tensor([2, 5, 2])).tolist() == [20, 50, 20]
    fm.stash(None)  # a middle prefill chunk sampled nothing
    fm.stash(RelayPayload(rows=torch.tensor([2]), bonus_tokens=torch.tensor([21])))
    assert fm.gather_bonus(torch.tensor([5, 2])).tolist() == [50, 21]


def test_debug_poison_catches_unwritten_gather():
    fm = FutureMap(8, "cpu", debug=True)
    fm.stash(RelayPayload(rows=torch.tensor([1]), bonus_tokens=torch.tensor([7])))
    assert fm.gather_bonus(torch.tensor([1])).tolist() == [7]
    with pytest.raises(FutureMapError, match=r"rows \[3\]"):
        fm.gather_bonus(torch.tensor([1, 3]))
    fm.poison([1])  # the request on row 1 left; a later step must not read its token
    with pytest.raises(FutureMapError):
        fm.gather_bonus(torch.tensor([1]))


def test_multi_token_speculative_payload():
    fm = FutureMap(4, "cpu", max_draft_tokens=3, debug=True)
    payload = RelayPayload(rows=torch.tensor([0, 3]), draft_tokens=torch.tensor([[1, 2, 3], [4, 5, 6]]),
                           accept_lens=torch.tensor([2, 3]))
    assert payload.is_speculative
    fm.stash(payload)
    drafts, accepted = fm.gather_draft(torch.tensor([3, 0]), 3)
    assert drafts.tolist() == [[4, 5, 6], [1, 2, 3]] and accepted.tolist() == [3, 2]
    with pytest.raises(FutureMapError):
        fm.gather_draft(torch.tensor([1]), 3)

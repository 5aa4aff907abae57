"""NGRAM drafting: longest recurring suffix first, most recent occurrence, bounded length."""
from __future__ import annotations

import numpy as np

from tandem.runtime.speculative.ngram import propose_ngram


def drafts(seq: list[int], k: int = 3, lo: int = 1, hi: int = 4) -> list[int]:
    return propose_ngram(np.asarray(seq, dtype=np.int64), k, lo, hi).tolist()


def test_continues_after_the_last_occurrence_of_the_suffix() -> None:
    assert drafts([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    assert drafts([1, 2, 3, 4, 5, 9, 1, 2, 3], k=1) == [4]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    # suffix [7, 8] recurs at the start (-> 1, 2); [8] alone recurs later (-> 5)
    assert drafts([7, 8, 1, 2, 0, 8, 5, 6, 7, 8]) == [1, 2, 0]
    # with the window capped at 1, only [8] is looked up: its most recent occurrence is followed by 5
    assert drafts([7, 8, 1, 2, 0, 8, 5, 6, 7, 8], hi=1) == [5, 6, 7]


def test_no_recurrence_no_drafts_and_short_tails() -> None:
    assert drafts([1, 2, 3, 4]) == []
    assert drafts([5]) == []
    assert drafts([3, 4, 3], k=5) == [4, 3]  # only two tokens follow the match
    assert drafts([9, 9, 9, 9], k=2) == [9]  # [9, 9, 9] recurs at the start, one token follows
    assert drafts([1, 2, 3, 1, 2], lo=3) == []  # min window 3: a 2-token suffix is not enough

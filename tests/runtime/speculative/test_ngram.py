"""NGRAM drafting: longest recurring suffix first, most recent occurrence, bounded length."""
from __future__ import annotations

import numpy as np
import pytest

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


def _brute_force(seq: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """The definition, window size by window size: the longest suffix in [lo, hi] tokens that
    occurs earlier with a token after it; its most recent occurrence's continuation."""
    n = len(seq)
    for w in range(min(hi, n - 1), lo - 1, -1):
        hits = [s for s in range(n - w) if (seq[s:s + w] == seq[n - w:]).all()]
        if hits:
            return seq[hits[-1] + w:hits[-1] + w + k].tolist()
    return []


def test_matches_the_definition_on_random_and_looping_histories() -> None:
    rng = np.random.default_rng(0)
    for case in range(300):
        n = int(rng.integers(1, 60))
        seq = rng.integers(0, 1 + case % 6, n)  # small alphabets: long and overlapping matches
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 20))
        assert propose_ngram(seq, 3, lo, hi).tolist() == _brute_force(seq, 3, lo, hi), (seq.tolist(), lo, hi)


@pytest.mark.timeout(60)  # a hang guard, not a timing: these calls take microseconds now, and took ~20 minutes
def test_a_large_max_window_costs_the_longest_match_not_every_window() -> None:
    """--speculative-ngram-max-match-window-size 8192 on a long request: trying every window size
    over the whole history took seconds per request and step (n=2000: 1.2 s; it grows as n^3),
    on the thread that runs the forward passes. Now one pass plus the candidates' extension."""
    history = np.random.default_rng(1).integers(0, 49152, 8000)
    history[-3:] = history[100:103]  # a 3-token suffix that recurred once, early on
    for _ in range(20):
        assert propose_ngram(history, 3, 1, 8192).tolist() == history[103:106].tolist()

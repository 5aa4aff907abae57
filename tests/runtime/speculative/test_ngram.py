"""NGRAM drafting: longest recurring suffix first, most recent occurrence, bounded length."""
from __future__ import annotations

import numpy as np
import pytest

from tandem.runtime.model.packed_linear import best_seconds
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


def _candidates_extended_together(seq: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """The previous implementation, kept as the reference for long histories: every candidate
    extended one token per round up to the longest match (0.1 s per call on the worst case below)."""
    n = len(seq)
    longest = min(hi, n - 1)
    ends = np.flatnonzero(seq[:n - 1] == seq[n - 1]) if longest >= 1 else seq[:0]
    width = 1
    while len(ends) and width < longest:
        still = ends >= width
        still[still] = seq[ends[still] - width] == seq[n - 1 - width]
        if not still.any():
            break
        ends, width = ends[still], width + 1
    if not len(ends) or width < lo:
        return []
    return seq[int(ends[-1]) + 1:int(ends[-1]) + 1 + k].tolist()


def _long_histories(rng: np.random.Generator):
    """Histories whose longest recurring suffix runs past the short-match phase: one token repeated
    after a random prefix, short loops with rare slips, a passage copied again, small alphabets."""
    for case in range(400):
        n = int(rng.integers(2, 700))
        kind = case % 4
        if kind == 0:
            seq = np.concatenate([rng.integers(0, 50, int(rng.integers(0, n))), np.full(n, 7)])[:n]
        elif kind == 1:
            seq = np.tile(rng.integers(0, 1 << 20, int(rng.integers(1, 30))), n)[:n]
            slips = rng.integers(0, n, int(rng.integers(0, 4)))
            seq[slips] = rng.integers(0, 3, len(slips))
        elif kind == 2:
            passage = rng.integers(0, 49152, int(rng.integers(1, n // 2 + 2)))
            copied = passage[int(rng.integers(0, len(passage))):]
            seq = np.concatenate([rng.integers(0, 49152, int(rng.integers(0, 50))), passage,
                                  rng.integers(0, 49152, int(rng.integers(0, 50))), copied])
        else:
            seq = rng.integers(0, 2, n)
        yield seq.astype(np.int64)


def test_long_matches_equal_the_previous_implementation() -> None:
    rng = np.random.default_rng(2)
    for seq in _long_histories(rng):
        lo = int(rng.integers(1, 40))
        hi = int(rng.choice([lo, lo + int(rng.integers(0, 40)), 8192]))
        want = _candidates_extended_together(seq, 4, lo, hi)
        assert propose_ngram(seq, 4, lo, hi).tolist() == want, (seq.tolist(), lo, hi)


def test_large_token_ids_match_whole_tokens_only() -> None:
    """Ids past 21 bits take more bytes per token; a byte match straddling tokens must not count."""
    rng = np.random.default_rng(3)
    alphabet = np.array([0, 127, 128, 1 << 21, (1 << 30) + 1, (1 << 31) - 1])
    for _ in range(100):
        seq = alphabet[rng.integers(0, len(alphabet), int(rng.integers(2, 300)))]
        seq[-40:] = seq[:40]  # a long match at the start
        assert propose_ngram(seq, 4, 1, 8192).tolist() == _candidates_extended_together(seq, 4, 1, 8192)
    a, c = 1 << 30, 5
    assert drafts([c, *[a] * 20, c, *[a] * 20], k=2, hi=100) == [c, a]


@pytest.mark.timeout(120)
def test_one_token_repeated_under_a_huge_window_costs_about_the_default_window() -> None:
    """--speculative-ngram-max-match-window-size 8192 on an output repeating one token (8000
    tokens): one round per matched token with every occurrence in it took 0.1 s per request and
    step, ~500x the default window's lookup on the same history. Now a few byte searches."""
    history = np.full(8000, 7, dtype=np.int64)
    history[:100] = np.arange(100)  # the prompt, then the repetition
    assert propose_ngram(history, 3, 1, 8192).tolist() == [7]
    default = best_seconds(lambda: propose_ngram(history, 3, 1, 12), 20)
    huge = best_seconds(lambda: propose_ngram(history, 3, 1, 8192), 5)
    assert huge < 20 * default, (huge, default)

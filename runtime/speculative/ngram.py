"""NGRAM drafts (prompt lookup): continue the sequence the way it continued the last time its
current suffix appeared earlier in the same request's prompt or output.

The longest suffix (up to the max match window) that occurred before wins; among its earlier
occurrences the most recent one. No draft model and no draft KV: the drafts are verified by
the target like any others, so a bad guess costs verify width, never correctness.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(history: np.ndarray, k: int, min_window: int, max_window: int) -> np.ndarray:
    """Up to k draft tokens following `history` (1-D int array); empty when no suffix recurs.

    Every earlier occurrence of the last token is a candidate match end; the candidates are
    extended backwards together, one token per round, while any still matches the suffix. So a
    step costs one pass over the history plus the candidates times the longest match, never the
    history times every window size (with a large max window that was seconds per request and step).
    """
    n = len(history)
    longest = min(max_window, n - 1)
    # match ends leave at least one token after them; extending a match to `width + 1` tokens
    # needs its start, end - width, inside the history
    ends = np.flatnonzero(history[:n - 1] == history[n - 1]) if longest >= 1 else history[:0]
    width = 1
    while len(ends) and width < longest:
        still = ends >= width
        still[still] = history[ends[still] - width] == history[n - 1 - width]
        if not still.any():
            break
        ends, width = ends[still], width + 1
    if not len(ends) or width < min_window:
        return history[:0]
    start = int(ends[-1]) + 1  # the most recent occurrence of the longest recurring suffix
    return history[start:start + k]

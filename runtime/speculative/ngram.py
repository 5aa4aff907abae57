"""NGRAM drafts (prompt lookup): continue the sequence the way it continued the last time its
current suffix appeared earlier in the same request's prompt or output.

The longest suffix (up to the max match window) that occurred before wins; among its earlier
occurrences the most recent one. No draft model and no draft KV: the drafts are verified by
the target like any others, so a bad guess costs verify width, never correctness.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(history: np.ndarray, k: int, min_window: int, max_window: int) -> np.ndarray:
    """Up to k draft tokens following `history` (1-D int array); empty when no suffix recurs."""
    n = len(history)
    for w in range(min(max_window, n - 1), min_window - 1, -1):
        suffix = history[n - w:]
        # windows that start before the suffix itself and leave at least one token after them
        windows = sliding_window_view(history[:n - 1], w)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + w
            return history[start:start + k]
    return history[:0]

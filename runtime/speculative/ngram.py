"""NGRAM drafts (prompt lookup): continue the sequence the way it continued the last time its
current suffix appeared earlier in the same request's prompt or output.

The longest suffix (up to the max match window) that occurred before wins; among its earlier
occurrences the most recent one. No draft model and no draft KV: the drafts are verified by
the target like any others, so a bad guess costs verify width, never correctness.

Cost: a match of at most `_SHORT` tokens (every match under the default window of 12) is found
by extending the earlier occurrences of the last token backwards together, microseconds for the
usual few candidates. A longer one continues by binary search over the window with byte searches
in the reversed history: O(log window) linear scans, so an output repeating one token under a
window of thousands costs under a millisecond per step, not one round per token of the match
with every occurrence in it (0.1 s at 8000 tokens).
"""
from __future__ import annotations

import numpy as np

_SHORT = 16  # match widths found candidate by candidate; longer ones by binary search


def propose_ngram(history: np.ndarray, k: int, min_window: int, max_window: int) -> np.ndarray:
    """Up to k draft tokens following `history` (1-D int array); empty when no suffix recurs."""
    longest = min(max_window, len(history) - 1)  # an occurrence leaves a token after it
    width, end = _short_match(history, min(longest, _SHORT))
    if width == _SHORT < longest:
        width, end = _long_match(history, width, end, longest)
    if width < max(min_window, 1):
        return history[:0]
    return history[end + 1:end + 1 + k]


def _short_match(history: np.ndarray, cap: int) -> tuple[int, int]:
    """The longest suffix of at most `cap` tokens that occurred before and where its latest such
    occurrence ends; (0, -1) when the last token is new. Every earlier occurrence of the last
    token is a candidate match end; the candidates are extended backwards together, one token
    per round, while any still matches."""
    n = len(history)
    ends = np.flatnonzero(history[:n - 1] == history[n - 1]) if cap >= 1 else history[:0]
    if not len(ends):
        return 0, -1
    width = 1
    while width < cap:
        # extending a match to width + 1 tokens needs its start, end - width, inside the history
        still = ends >= width
        still[still] = history[ends[still] - width] == history[n - 1 - width]
        if not still.any():
            break
        ends, width = ends[still], width + 1
    return width, int(ends[-1])


def _long_match(history: np.ndarray, width: int, end: int, longest: int) -> tuple[int, int]:
    """`_short_match` continued up to `longest` tokens from a `width`-token match ending at `end`.
    Reversed, the history's suffixes are prefixes and the first later match of one is the latest
    occurrence; whether a w-token suffix recurs is monotone in w, so binary search finds the
    longest. CPython's bytes.find is linear at worst (it falls back to the two-way algorithm)."""
    n = len(history)
    text, g = _token_bytes(history[::-1])
    lo, hi, at = width, longest, (n - 1 - end) * g
    while lo < hi:  # invariant: the lo-token suffix recurs, its latest occurrence at byte `at`
        mid = (lo + hi + 1) // 2
        if (hit := text.find(text[:mid * g], g)) >= 0:
            lo, at = mid, hit
        else:
            hi = mid - 1
    return lo, n - 1 - at // g


def _token_bytes(tokens: np.ndarray) -> tuple[bytes, int]:
    """Each token as g bytes of 7 bits, big-endian, the first with its top bit set; g. Only token
    starts have that bit, so a byte match of whole tokens starts and ends on token boundaries."""
    g = max(1, -(-int(tokens.max()).bit_length() // 7))
    shifts = np.arange(7 * (g - 1), -1, -7, dtype=np.uint32)
    out = ((tokens.astype(np.uint32)[:, None] >> shifts) & 0x7F).astype(np.uint8)
    out[:, 0] |= 0x80
    return out.tobytes(), g

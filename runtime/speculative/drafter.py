"""Drafters: the worker-side owners of what speculation needs between steps.

A drafter keeps each pool row's token history (prompt + output, written as steps run on the
worker) and proposes the next step's drafts right after a step's tokens are known, so the
scheduler never waits for them: they travel to the next verify through the future map.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from tandem.runtime.speculative.ngram import propose_ngram


class Drafter(Protocol):
    num_drafts: int  # K: drafts proposed per request and step, at most

    def start(self, row: int, tokens: list[int]) -> None: ...
    def append(self, row: int, pos: int, tokens: list[int]) -> None: ...
    def propose(self, rows: list[int], seq_lens: list[int], make: list[bool],
                pos_limits: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Drafts [B, K] (zero-padded) and their counts [B] for rows whose last token sits at
        seq_lens; nothing is computed at or past a row's pos_limit."""
        ...


class NgramDrafter:
    def __init__(self, num_rows: int, row_width: int, num_drafts: int, min_window: int, max_window: int) -> None:
        self.num_drafts = num_drafts
        self.min_window, self.max_window = min_window, max_window
        self.history = np.zeros((num_rows, row_width), dtype=np.int64)

    def start(self, row: int, tokens: list[int]) -> None:
        """A prefill: the row's history is the request's tokens so far."""
        self.history[row, :len(tokens)] = tokens

    def append(self, row: int, pos: int, tokens: list[int]) -> None:
        """Tokens accepted at positions [pos, pos + len(tokens))."""
        self.history[row, pos:pos + len(tokens)] = tokens

    def propose(self, rows: list[int], seq_lens: list[int], make: list[bool],
                pos_limits: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """No KV is written, so the position limit does not matter (the planner caps each verify)."""
        k = self.num_drafts
        drafts = np.zeros((len(rows), k), dtype=np.int64)
        lens = np.zeros(len(rows), dtype=np.int64)
        for i, (row, last, ok) in enumerate(zip(rows, seq_lens, make)):
            if not ok:
                continue
            found = propose_ngram(self.history[row, :last + 1], k, self.min_window, self.max_window)
            drafts[i, :len(found)] = found
            lens[i] = len(found)
        return drafts, lens

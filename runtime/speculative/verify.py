"""Verifying drafts: the layout of one verify pass and which tokens each request keeps.

At every position of a request's run [last token, d1, ..., dn] the target samples a token with
the ordinary sampler, seeded by (request seed, position) as plain decoding would. The request
keeps those tokens while each equals the draft that follows it, then the first one that does
not (or the bonus after the last draft). Drafts are deterministic (n-gram lookup, a greedy
draft model), and for a deterministic draft d this is exactly rejection sampling: d survives
with probability p(d), and a rejected position yields a sample of p restricted to tokens other
than d, i.e. the normalised residual (p - q)+. So the output distribution is that of plain
decoding, and because the noise is the same, a request's tokens are the very ones plain
decoding gives it, greedy or seeded.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyLayout:
    """Where each request's run sits in the pass's flattened token dimension."""

    seq_lens: list[int]  # per request: position of its last token, the run's first input
    num_drafts: list[int]
    offsets: list[int]  # per request: index of its first token
    row_of: list[int]  # per token: its request (batch index)
    cols: list[int]  # per token: its index in the run (0 = the last token)

    @staticmethod
    def build(seq_lens: list[int], num_drafts: list[int]) -> "VerifyLayout":
        offsets, row_of, cols = [], [], []
        for i, n in enumerate(num_drafts):
            offsets.append(len(row_of))
            row_of.extend([i] * (n + 1))
            cols.extend(range(n + 1))
        return VerifyLayout(list(seq_lens), list(num_drafts), offsets, row_of, cols)

    @property
    def num_tokens(self) -> int:
        return len(self.row_of)

    def positions(self) -> list[int]:
        return [self.seq_lens[i] + j for i, j in zip(self.row_of, self.cols)]

    def kept_indices(self, runs: list[list[int]]) -> list[int]:
        """Flattened token indices whose sampled token each request keeps, in order."""
        return [self.offsets[i] + j for i, run in enumerate(runs) for j in range(len(run))]


def accept_runs(sampled: list[int], drafts: list[list[int]], layout: VerifyLayout) -> list[list[int]]:
    """Per request, the tokens it keeps from one verify pass (at least one: the bonus)."""
    runs = []
    for i, (off, n) in enumerate(zip(layout.offsets, layout.num_drafts)):
        run = sampled[off:off + n + 1]
        accepted = 0
        while accepted < n and run[accepted] == drafts[i][accepted]:
            accepted += 1
        runs.append(run[:accepted + 1])
    return runs

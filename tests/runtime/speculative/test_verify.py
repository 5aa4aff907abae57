"""Verify layout and acceptance, and that accepting while the seeded sample equals the draft keeps
the target's distribution (the rejection-sampling argument in verify.py), by chi-square."""
from __future__ import annotations

import numpy as np
import torch

from tandem.runtime.sampling.sampler import SamplingBatchInfo, sample
from tandem.runtime.speculative.verify import VerifyLayout, accept_runs


def test_layout_flattens_runs_in_order() -> None:
    lay = VerifyLayout.build([10, 4, 7], [2, 0, 1])
    assert lay.offsets == [0, 3, 4] and lay.row_of == [0, 0, 0, 1, 2, 2] and lay.cols == [0, 1, 2, 0, 0, 1]
    assert lay.positions() == [10, 11, 12, 4, 7, 8] and lay.num_tokens == 6


def test_a_run_keeps_matches_then_the_first_mismatch_or_the_bonus() -> None:
    lay = VerifyLayout.build([0, 0, 0, 0], [3, 3, 0, 2])
    sampled = [5, 6, 9, 1,   7, 8, 8, 8,   4,   2, 3, 4]
    drafts = [[5, 6, 7], [1, 8, 8], [], [2, 3]]
    runs = accept_runs(sampled, drafts, lay)
    assert runs == [[5, 6, 9], [7], [4], [2, 3, 4]]
    assert lay.kept_indices(runs) == [0, 1, 2, 4, 8, 9, 10, 11]


def test_acceptance_keeps_the_target_distribution() -> None:
    """Two tokens from a toy model over 6 tokens (the second token's logits depend on the first)
    with a fixed two-token draft: verify runs, continued by a plain step after an early
    rejection, must give the joint distribution p(t1) p(t2 | t1) of plain sampling."""
    vocab, n, temperature, draft = 6, 20_000, 0.8, [1, 0]
    gen = torch.Generator().manual_seed(0)
    first_logits = torch.randn(vocab, generator=gen) * 0.5
    next_logits = torch.randn(vocab, vocab, generator=gen) * 0.5  # row t: logits after token t
    seeds = np.random.default_rng(0).integers(0, 2**62, size=n).tolist()

    def sample_at(logits: torch.Tensor, pos: int) -> list[int]:
        info = SamplingBatchInfo.build([temperature] * n, [1.0] * n, [-1] * n, [0.0] * n, seeds, vocab)
        return sample(logits.contiguous(), info, torch.full((n,), pos)).tolist()

    # the verify pass: position 0 sees the prompt, position 1 sees the draft's first token
    y0 = sample_at(first_logits.expand(n, vocab), 10)
    y1 = sample_at(next_logits[draft[0]].expand(n, vocab), 11)
    lay = VerifyLayout.build([9] * n, [1] * n)
    runs = accept_runs([t for pair in zip(y0, y1) for t in pair], [draft[:1]] * n, lay)
    # a request whose draft was rejected gets its second token from the next (plain) step
    after = sample_at(next_logits[torch.tensor([r[0] for r in runs])], 11)
    pairs = [(r[0], r[1] if len(r) == 2 else a) for r, a in zip(runs, after)]
    observed = np.zeros((vocab, vocab))
    for a, b in pairs:
        observed[a, b] += 1
    p1 = torch.softmax(first_logits.double() / temperature, -1)
    p2 = torch.softmax(next_logits.double() / temperature, -1)
    expected = (p1[:, None] * p2).numpy() * n
    assert expected.min() > 20  # the chi-square approximation needs well-filled cells
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 66.62  # chi-square, 35 degrees of freedom, p = 0.001
    accept_rate = float(np.mean([len(r) == 2 for r in runs]))
    assert abs(accept_rate - float(p1[draft[0]])) < 0.02  # a draft survives with probability p(draft)

"""The token-bitmask kernel against its torch reference (Triton interpreter on CPU) and against
xgrammar's packing (bit j of word w allows token 32 w + j)."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.reference import apply_token_bitmask_ref
from tandem.kernels.token_bitmask import apply_token_bitmask


def _random_case(n: int, b: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (b, words), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.randperm(n, generator=g)[:b]
    return logits, bitmask, rows


@pytest.mark.parametrize("n, b, vocab", [(4, 2, 100), (3, 3, 64), (5, 1, 1000), (2, 0, 50)])
def test_kernel_matches_reference(n, b, vocab):
    logits, bitmask, rows = _random_case(n, b, vocab, seed=n * 100 + vocab)
    expected, actual = logits.clone(), logits.clone()
    apply_token_bitmask_ref(expected, bitmask, rows)
    apply_token_bitmask(actual, bitmask, rows, block=64)
    assert torch.equal(expected, actual)


def test_bit_layout_and_untouched_rows():
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[0, 2] = 1 << 5  # token 69
    apply_token_bitmask(logits, bitmask, torch.tensor([1]), block=32)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == [0, 2, 69]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_matches_xgrammar_packing():
    import xgrammar as xgr  # a hard dependency: a broken install fails here, it is not skipped
    logits = torch.randn(2, 100)
    bitmask = xgr.allocate_token_bitmask(2, 100)
    bitmask[0].zero_()
    bitmask[0, 1] = 1 << 3  # token 35 only
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, torch.tensor([0, 1]), block=64)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask(torch.zeros(2, 100), torch.zeros(1, 3, dtype=torch.int32), torch.tensor([0]))

"""Penalties, logit bias and min-new-tokens bans, plus the per-row output counts."""

from __future__ import annotations

import torch

from tandem.runtime.sampling.penalties import PenaltyCounts, apply_penalties

V = 8


def _logits() -> torch.Tensor:
    # Row 0 and row 1 are identical; only row 0 gets a penalty, so row 1 is the control.
    row = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0, 0.0, 3.0, 1.5])
    return torch.stack([row, row.clone()])


def _counts(row0: dict[int, int]) -> torch.Tensor:
    c = torch.zeros((2, V), dtype=torch.int32)
    for tok, n in row0.items():
        c[0, tok] = n
    return c


def _apply(**kw: object) -> torch.Tensor:
    zeros, ones = torch.zeros(2), torch.ones(2)
    args = dict(frequency=zeros, presence=zeros, repetition=ones)
    args.update(kw)  # type: ignore[arg-type]
    counts = args.pop("counts", _counts({0: 2, 1: 1}))
    return apply_penalties(_logits(), counts, **args)  # type: ignore[arg-type]


def test_defaults_are_identity() -> None:
    logits = _logits()
    out = _apply()
    assert torch.equal(out, logits)


def test_input_is_not_modified() -> None:
    logits = _logits()
    before = logits.clone()
    apply_penalties(logits, _counts({0: 1}), torch.ones(2), torch.ones(2), torch.full((2,), 1.5))
    assert torch.equal(logits, before)


def test_repetition_pushes_seen_tokens_down_both_signs() -> None:
    out = _apply(repetition=torch.tensor([2.0, 1.0]))
    assert out[0, 0] == 1.0  # positive logit 2.0 divided by 2
    assert out[0, 1] == -4.0  # negative logit -2.0 multiplied by 2
    assert torch.equal(out[0, 2:], _logits()[0, 2:])  # unseen tokens untouched
    assert torch.equal(out[1], _logits()[1])


def test_repetition_below_one_encourages() -> None:
    out = _apply(repetition=torch.tensor([0.5, 1.0]))
    assert out[0, 0] == 4.0 and out[0, 1] == -1.0


def test_repetition_scales_what_frequency_left() -> None:
    # SGLang's order: additive penalties first, then the scaling one. Token 0 (logit 2, seen
    # twice) with frequency 1 and repetition 2: (2 - 2) / 2 = 0, not 2 / 2 - 2 = -1.
    out = _apply(frequency=torch.tensor([1.0, 0.0]), repetition=torch.tensor([2.0, 1.0]))
    assert out[0, 0] == 0.0
    assert out[0, 1] == (-2.0 - 1.0) * 2  # token 1 (logit -2, seen once) goes negative, so multiplied


def test_frequency_scales_with_count() -> None:
    out = _apply(frequency=torch.tensor([0.5, 0.0]))
    assert out[0, 0] == 2.0 - 0.5 * 2 and out[0, 1] == -2.0 - 0.5 * 1
    assert torch.equal(out[1], _logits()[1])


def test_negative_frequency_raises_seen_tokens() -> None:
    out = _apply(frequency=torch.tensor([-1.0, 0.0]))
    assert out[0, 0] == 4.0


def test_presence_is_flat_per_seen_token() -> None:
    out = _apply(presence=torch.tensor([1.0, 0.0]))
    assert out[0, 0] == 1.0 and out[0, 1] == -3.0  # count 2 and 1, same penalty
    assert out[0, 2] == _logits()[0, 2]


def test_logit_bias_forces_argmax() -> None:
    bias = torch.zeros((2, V))
    bias[0, 4] = 100.0
    out = _apply(logit_bias=bias)
    assert out[0].argmax() == 4 and out[1].argmax() == 6


def _bans(*rows: list[int]) -> torch.Tensor:
    mask = torch.zeros((len(rows), V), dtype=torch.bool)
    for i, ids in enumerate(rows):
        mask[i, ids] = True
    return mask


def test_min_tokens_bans_eos_and_stop_ids_only_on_masked_rows() -> None:
    out = _apply(ban_mask=_bans([3, 6], []))
    assert out[0, 6] == float("-inf") and out[0, 3] == float("-inf")
    assert out[0].argmax() == 0  # EOS (token 6) was the argmax before the ban
    assert torch.equal(out[1], _logits()[1])


def test_a_grammar_that_allows_only_its_end_outlasts_min_tokens() -> None:
    """Row 0's grammar has ended (only EOS, token 6, is allowed): banning EOS would leave nothing
    to sample, so its bans are lifted. Row 1's grammar still allows token 2: its bans hold."""
    masked = torch.full((2, V), float("-inf"))
    masked[0, 6] = 3.0
    masked[1, [2, 6]] = torch.tensor([1.0, 3.0])
    out = apply_penalties(masked, None, None, None, None, ban_mask=_bans([6], [6]), grammar_masked=True)
    assert out[0].argmax() == 6 and out[0, 6] == 3.0
    assert out[1, 6] == float("-inf") and out[1].argmax() == 2
    unflagged = apply_penalties(masked, None, None, None, None, ban_mask=_bans([6], [6]))
    assert torch.isneginf(unflagged[0]).all()  # without the flag a ban is a ban


def test_rows_ban_different_ids_and_an_empty_row_bans_none() -> None:
    out = _apply(ban_mask=_bans([3, 6, 1], []))
    assert torch.isneginf(out[0, [1, 3, 6]]).all() and not torch.isneginf(out[0]).all()
    assert torch.equal(out[1], _logits()[1])


# ---- PenaltyCounts -----------------------------------------------------------------------


def test_counts_are_made_on_first_reset_and_reset_per_row() -> None:
    counts = PenaltyCounts(num_rows=3, vocab_size=V)
    assert counts.counts is None
    counts.add(torch.tensor([0]), torch.tensor([1]))  # nothing to count into yet: a no-op
    counts.reset_row(1, [0, 0, 5])
    assert counts.gather(torch.tensor([1])).tolist()[0][:6] == [2, 0, 0, 0, 0, 1]
    counts.add(torch.tensor([1, 2]), torch.tensor([5, 3]))
    assert counts.counts[1, 5] == 2 and counts.counts[2, 3] == 1
    counts.reset_row(1, [])  # the row goes to a new request: the old counts must not leak
    assert counts.counts[1].sum() == 0 and counts.counts[2, 3] == 1


def test_counts_drive_frequency_penalty() -> None:
    counts = PenaltyCounts(num_rows=2, vocab_size=V)
    counts.reset_row(0, [0, 0])
    rows = torch.tensor([0, 1])
    counts.reset_row(1, [])
    out = apply_penalties(_logits(), counts.gather(rows), torch.tensor([1.0, 1.0]), None, None)
    assert out[0, 0] == _logits()[0, 0] - 2 and torch.equal(out[1], _logits()[1])

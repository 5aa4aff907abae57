"""Penalties, logit bias and min-new-tokens bans, plus the batch PenaltyState."""

from __future__ import annotations

import pytest
import torch

from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.sampling.penalties import PenaltyState, apply_penalties, ban_index

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


def test_min_tokens_bans_eos_and_stop_ids_only_on_masked_rows() -> None:
    mask = torch.tensor([True, False])
    out = _apply(min_tokens_mask=mask, eos_ids=[6], banned_ids=[[3], [3]])
    assert out[0, 6] == float("-inf") and out[0, 3] == float("-inf")
    assert out[0].argmax() == 0  # EOS (token 6) was the argmax before the ban
    assert torch.equal(out[1], _logits()[1])


def test_ban_index_pads_with_minus_one() -> None:
    idx = ban_index([[1], [], [2, 3]], eos_ids=[7])
    assert idx.tolist() == [[7, 1, -1], [7, -1, -1], [7, 2, 3]]
    assert ban_index([[], []]).tolist() == [[-1], [-1]]


def test_tensor_banned_ids_match_list_form() -> None:
    mask = torch.tensor([True, True])
    a = _apply(min_tokens_mask=mask, eos_ids=[6], banned_ids=[[3], []])
    b = _apply(min_tokens_mask=mask, eos_ids=[6], banned_ids=ban_index([[3], []]))
    assert torch.equal(a, b)


# ---- PenaltyState ------------------------------------------------------------------------


def test_state_inactive_for_default_params_and_returns_logits_as_is() -> None:
    st = PenaltyState([SamplingParams(), SamplingParams()], V)
    logits = _logits()
    assert not st.active and st.counts is None and st.apply(logits) is logits


def test_state_counts_from_output_and_updates() -> None:
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    st = PenaltyState(params, V, output_ids=[[0, 0], [5]])
    assert st.active and st.counts is not None
    assert st.counts[0, 0] == 2 and st.counts[1, 5] == 1
    st.update(torch.tensor([0, 2]))
    assert st.counts[0, 0] == 3 and st.counts[1, 2] == 1
    st.update(torch.tensor([[1, -1], [3, 4]]))  # speculative: padded with -1
    assert st.counts[0].sum() == 4 and st.counts[1].sum() == 4
    assert st.output_len.tolist() == [4, 4]
    out = st.apply(_logits())
    assert out[0, 0] == 2.0 - 3 and torch.equal(out[1], _logits()[1])


def test_state_min_new_tokens_lifts_after_enough_tokens() -> None:
    params = [SamplingParams(min_new_tokens=2, stop_token_ids=[3]), SamplingParams()]
    st = PenaltyState(params, V, eos_ids=[6])
    assert st.active and st.counts is None
    out = st.apply(_logits())
    assert out[0, 6] == float("-inf") and out[0, 3] == float("-inf")
    assert out[1, 6] == 3.0
    st.update(torch.tensor([1, 1]))
    st.update(torch.tensor([1, 1]))
    assert torch.equal(st.apply(_logits()), _logits())


def test_state_logit_bias() -> None:
    st = PenaltyState([SamplingParams(logit_bias={2: 50.0}), SamplingParams()], V)
    out = st.apply(_logits())
    assert out[0].argmax() == 2 and out[1].argmax() == 6


def test_state_filter_and_merge() -> None:
    a = PenaltyState([SamplingParams(), SamplingParams(presence_penalty=1.0)], V,
                     output_ids=[[1], [0]])  # fmt: skip
    b = PenaltyState([SamplingParams(logit_bias={4: 9.0}, min_new_tokens=1)], V, eos_ids=[6])
    a.merge(b)
    assert a.batch_size == 3 and a.counts is not None and a.logit_bias is not None
    assert a.counts.shape == (3, V) and a.banned.shape[0] == 3
    a.filter([2, 1])
    assert a.batch_size == 2
    logits = torch.stack([_logits()[0]] * 2)
    out = a.apply(logits)
    assert out[0, 4] == -1.0 + 9.0 and out[0, 6] == float("-inf")  # old b row
    assert out[1, 0] == 2.0 - 1.0  # old a row 1: presence on token 0
    assert a.presence.tolist() == [0.0, 1.0]


def test_state_merge_into_empty_counts_keeps_other_rows_exact() -> None:
    a = PenaltyState([SamplingParams()], V)
    b = PenaltyState([SamplingParams(repetition_penalty=2.0)], V, output_ids=[[0]])
    a.merge(b)
    out = a.apply(_logits())
    assert torch.equal(out[0], _logits()[0]) and out[1, 0] == 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares CUDA against CPU; runs on GPU machines only")
def test_state_on_cuda_matches_cpu() -> None:
    first = SamplingParams(
        frequency_penalty=0.5, repetition_penalty=1.3, min_new_tokens=3, logit_bias={1: 2.0}
    )
    params = [first, SamplingParams(presence_penalty=-1.0)]
    cpu = PenaltyState(params, V, eos_ids=[6], output_ids=[[0, 2], [2]])
    gpu = PenaltyState(params, V, eos_ids=[6], output_ids=[[0, 2], [2]], device="cuda")
    for st in (cpu, gpu):
        st.update(torch.tensor([5, 0], device=st.device))
    out = gpu.apply(_logits().cuda())
    assert out.is_cuda and torch.allclose(out.cpu(), cpu.apply(_logits()))

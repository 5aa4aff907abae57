"""The batched sampler without processes: greedy ids read in the logits' dtype equal those of the
float32 logits; seeded rows sample the same token whatever shares the batch; top-k 1 is greedy;
top-k / top-p / min-p never sample a token they exclude."""
from __future__ import annotations

import pytest
import torch

from tandem.runtime.sampling.sampler import SamplingBatchInfo, greedy_ids, sample

pytestmark = pytest.mark.timeout(120)

VOCAB = 300


def info(n: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
         seeds: list[int] | None = None) -> SamplingBatchInfo:
    return SamplingBatchInfo.build([temperature] * n, [top_p] * n, [top_k] * n, [min_p] * n,
                                   seeds or list(range(n)), VOCAB)


def logits_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_reads_the_model_dtype_as_float32(dtype):
    logits = logits_of(16).to(dtype)
    logits[2, [10, 20]] = 40  # a tie: the first id
    want = logits.float().argmax(-1)
    assert want[2].item() == 10
    assert torch.equal(greedy_ids(logits), want)
    assert torch.equal(sample(logits, info(16), torch.arange(16)), want)


def test_random_rows_sample_bf16_logits_as_their_float32_widening():
    logits = logits_of(8).bfloat16()
    params = info(8, temperature=0.8, top_p=0.9)
    positions = torch.arange(8) + 5
    assert torch.equal(sample(logits, params, positions), sample(logits.float(), params, positions))


def test_a_seeded_row_samples_the_same_token_in_any_batch():
    logits = logits_of(6)
    alone = sample(logits[3:4], info(1, temperature=1.0, seeds=[1234]), torch.tensor([9]))
    batch = sample(logits, info(6, temperature=1.0, seeds=[7, 8, 9, 1234, 10, 11]), torch.full((6,), 9))
    assert batch[3] == alone[0]


def test_top_k_one_is_greedy():
    logits = logits_of(10)
    assert torch.equal(sample(logits, info(10, temperature=1.5, top_k=1), torch.arange(10)), logits.argmax(-1))


@pytest.mark.parametrize("setting", [{"top_k": 3}, {"top_p": 0.3}, {"min_p": 0.5}])
def test_filters_never_sample_an_excluded_token(setting):
    logits = logits_of(1).repeat(200, 1)  # one distribution, 200 seeds
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    if "top_k" in setting:
        allowed = set(order[:3].tolist())
    elif "top_p" in setting:
        before = probs[order].cumsum(0) - probs[order]
        allowed = set(order[before < 0.3].tolist())
    else:
        allowed = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    got = sample(logits, info(200, temperature=1.0, seeds=list(range(200)), **setting), torch.zeros(200))
    assert set(got.tolist()) <= allowed
    if len(allowed) > 1:
        assert len(set(got.tolist())) > 1  # really sampling, not collapsing to the top token


def test_a_logit_bias_near_float32s_maximum_forces_its_token_under_a_temperature_below_one():
    """logit_bias takes any finite float32: divided by a temperature < 1 it must not overflow into
    inf (softmax NaN, whose argmax is token 0)."""
    logits = logits_of(4)
    logits[:, 7] += 3e38
    for top_p in (1.0, 0.9):  # the plain race and the filtered one
        assert sample(logits, info(4, temperature=0.5, top_p=top_p), torch.arange(4)).tolist() == [7] * 4

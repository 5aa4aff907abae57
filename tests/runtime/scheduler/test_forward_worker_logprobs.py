"""Output logprobs are of the distribution the sampler drew from, as SGLang's by default: the logits
after the grammar mask, penalties, logit bias and min-new-tokens bans, divided by each row's
temperature (1 for greedy rows), before top-k/top-p/min-p, clamped to float32's minimum (a masked
token reads -3.4e38, never -inf). TANDEM_RETURN_ORIGINAL_LOGPROB leaves out the temperature.

Process-free: a worker over a stub runner (nothing runs on its thread); the tests call its
sampling path as `run` and `_run_verify` do and compare with a torch reference.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tandem.runtime.grammar.mask import GrammarMask
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.sampling.penalties import PenaltyCounts
from tandem.runtime.sampling.sampler import SamplingBatchInfo
from tandem.runtime.scheduler.forward_worker import ForwardJob, ForwardWorker, PenaltyInfo
from tandem.runtime.scheduler.stats import StepStats
from tandem.runtime.speculative.verify import VerifyLayout

V = 40
FLOOR = torch.finfo(torch.float32).min
ALLOWED = [1, 3, 7, 9]  # the grammar of request 0 allows only these


class _Runner:
    device = torch.device("cpu")

    def pack_weights(self) -> None:
        pass


class _Backend:
    """A grammar backend whose one matcher allows ALLOWED (xgrammar's bitmask layout)."""

    @staticmethod
    def bitmask_buffer(n: int) -> torch.Tensor:
        return torch.zeros((n, math.ceil(V / 32)), dtype=torch.int32)

    @staticmethod
    def fill_bitmask(matchers: list, bitmask: torch.Tensor) -> None:
        for t in ALLOWED:
            bitmask[:, t // 32] |= 1 << (t % 32)


def _worker() -> ForwardWorker:
    counts = PenaltyCounts(8, V)
    for row in range(8):
        counts.reset_row(row, [])
    return ForwardWorker(_Runner(), None, counts, StepStats(), None, torch.get_num_threads())  # type: ignore[arg-type]


def _penalties(n: int, bias: dict[tuple[int, int], float], bans: dict[int, list[int]]) -> PenaltyInfo:
    logit_bias = torch.zeros((n, V))
    for (row, tok), v in bias.items():
        logit_bias[row, tok] = v
    ban_mask = torch.zeros((n, V), dtype=torch.bool)
    for row, ids in bans.items():
        ban_mask[row, ids] = True
    return PenaltyInfo(frequency=torch.zeros(n), presence=torch.zeros(n), repetition=torch.ones(n),
                       logit_bias=logit_bias, ban_mask=ban_mask, counts_active=True)


def _decode_job(grammar: bool = True) -> ForwardJob:
    """Three requests: 0 samples at temperature 0.5 with a logit bias and a grammar; 1 asks for no
    logprobs; 2 is greedy (temperature 0) with a min-new-tokens ban on token 5."""
    info = SamplingBatchInfo.build([0.5, 0.8, 0.0], [1.0] * 3, [-1] * 3, [0.0] * 3, [11, 12, 13], V)
    mask = None
    if grammar:
        mask = GrammarMask([0])
        mask.fill([object()], _Backend(), torch.device("cpu"))
    return ForwardJob(mode=ForwardMode.DECODE, rows=[0, 1, 2], prefix_lens=[4] * 3, extend_lens=[1] * 3,
                      input_ids=None, out_cache_loc=torch.zeros(3, dtype=torch.int64), sample_indices=[0, 1, 2],
                      sampling=info, sample_positions=[5] * 3, top_logprobs_nums=[3, -1, 2],
                      token_ids_logprob=[(1, 2, 7), None, None],
                      penalties=_penalties(3, {(0, 7): 2.0, (0, 2): 1.0}, {2: [5]}), grammar_mask=mask)


def _processed(logits: torch.Tensor, grammar: bool = True) -> torch.Tensor:
    """The reference: what the sampler sees for _decode_job's rows."""
    x = logits.clone()
    if grammar:
        banned = torch.ones(V, dtype=torch.bool)
        banned[ALLOWED] = False
        x[0, banned] = float("-inf")
    x[0, 7] += 2.0
    x[0, 2] += 1.0  # a bias cannot revive a masked token
    x[2, 5] = float("-inf")
    return x


def _reference(processed: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    t = torch.tensor(temperatures)[:, None]
    return torch.log(torch.softmax(processed / t, dim=-1)).clamp(min=FLOOR)  # SGLang's expression


def _decode_logprobs(worker: ForwardWorker, logits: torch.Tensor, job: ForwardJob):
    """What `ForwardWorker.run` does after the forward, for a one-token-per-request step."""
    sampled = worker._sample(logits, job, torch.tensor(job.sample_positions), torch.tensor(job.rows))
    each = list(range(len(job.rows)))
    return sampled.ids, worker._output_logprobs(sampled, each, job, each, [1] * len(each))


def _check_row(block, ref_row: torch.Tensor, token: int, k: int, ids: tuple[int, ...] = ()) -> None:
    arr = block[0]
    assert len(block) == 1 and arr.token_ids.tolist() == [token]
    np.testing.assert_allclose(arr.token_logprobs, [ref_row[token].item()], rtol=1e-5)
    vals, idx = torch.topk(ref_row, k)
    np.testing.assert_allclose(arr.top_vals[0], vals.numpy(), rtol=1e-5)
    assert arr.top_idx[0].tolist() == idx.tolist()
    np.testing.assert_allclose(arr.ids_logprobs[0], ref_row[list(ids)].numpy(), rtol=1e-5)
    for values in (arr.token_logprobs, arr.top_vals, arr.ids_logprobs):
        assert np.isfinite(values).all()  # JSON-safe: a masked token is the float32 floor, not -inf


def test_output_logprobs_are_of_the_processed_temperature_scaled_distribution(monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_RETURN_ORIGINAL_LOGPROB", raising=False)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 2
    job = _decode_job()
    ids, out = _decode_logprobs(_worker(), logits, job)
    ref = _reference(_processed(logits), [0.5, 0.8, 1.0])  # greedy: temperature 1
    assert ids[0].item() in ALLOWED and out[1] is None
    _check_row(out[0], ref[0], ids[0].item(), 3, (1, 2, 7))
    _check_row(out[2], ref[2], ids[2].item(), 2)
    assert out[0][0].ids_logprobs[0, 1] == FLOOR  # token 2: masked by the grammar, whatever its bias
    assert ids[2].item() == _processed(logits)[2].argmax().item()


def test_original_logprob_switch_leaves_out_the_temperature(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_RETURN_ORIGINAL_LOGPROB", "1")
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 2
    ids, out = _decode_logprobs(_worker(), logits, _decode_job())
    ref = _reference(_processed(logits), [1.0, 1.0, 1.0])  # still after the mask, bias and bans
    _check_row(out[0], ref[0], ids[0].item(), 3, (1, 2, 7))
    _check_row(out[2], ref[2], ids[2].item(), 2)


def test_top_k_one_keeps_its_temperature_for_logprobs() -> None:
    # SGLang turns only temperature 0 into temperature 1 + top-k 1; an explicit top_k=1 samples
    # greedily but its logprobs keep the request's temperature
    info = SamplingBatchInfo.build([0.0, 1.5], [1.0, 1.0], [-1, 1], [0.0, 0.0], [1, 2], V)
    assert info.temperatures.tolist() == [1.0, 1.5] and info.is_greedy.tolist() == [True, True]


def test_no_logprobs_asked_costs_nothing() -> None:
    job = _decode_job(grammar=False)
    job.top_logprobs_nums = [-1, -1, -1]
    _, out = _decode_logprobs(_worker(), torch.randn(3, V), job)
    assert out == []


def test_verify_logprobs_spread_each_requests_settings_over_its_kept_tokens(monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_RETURN_ORIGINAL_LOGPROB", raising=False)
    # request 0 checks two drafts (three logits rows), request 1 none (one row)
    layout = VerifyLayout.build([10, 20], [2, 0])
    row_of = torch.tensor(layout.row_of)
    info = SamplingBatchInfo.build([0.7, 1.3], [1.0, 1.0], [-1, -1], [0.0, 0.0], [5, 6], V)
    job = ForwardJob(mode=ForwardMode.TARGET_VERIFY, rows=[0, 1], prefix_lens=[10, 20], extend_lens=[3, 1],
                     input_ids=None, out_cache_loc=torch.zeros(4, dtype=torch.int64), sample_indices=[0, 1],
                     sampling=info, sample_positions=[11, 21], top_logprobs_nums=[2, 1], token_ids_logprob=[None, (4,)],
                     penalties=_penalties(2, {(1, 4): -3.0}, {}))
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    worker = _worker()
    sampled = worker._sample(logits, job, torch.tensor(layout.positions()) + 1, torch.tensor([0, 1])[row_of],
                             (layout, row_of))
    kept_rows = [0, 1, 3]  # request 0 kept two tokens, request 1 its bonus
    out = worker._output_logprobs(sampled, kept_rows, job, [0, 0, 1], [2, 1])
    processed = logits.clone()
    processed[3, 4] -= 3.0
    ref = _reference(processed, [0.7, 0.7, 0.7, 1.3])
    assert [len(b) for b in out] == [2, 1]  # type: ignore[arg-type]
    for block, row in zip([out[0][0], out[0][1], out[1][0]], kept_rows):  # type: ignore[index]
        token = sampled.ids[row].item()
        _check_row([block], ref[row], token, 2 if row < 3 else 1, () if row < 3 else (4,))

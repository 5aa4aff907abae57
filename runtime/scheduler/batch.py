"""ScheduleBatch: the requests of one planned step and the ForwardJob that runs it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.sampling.sampler import SamplingBatchInfo
from tandem.runtime.scheduler.forward_worker import ForwardJob, InputLogprobTask, PenaltyInfo
from tandem.runtime.scheduler.request import Req


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    sampling_reqs: list[Req]  # the subset whose pass samples a token, in job order
    job: ForwardJob
    input_logprob_reqs: list[Req]  # indexed by InputLogprobTask.req_index
    rows_to_free: list[int] = field(default_factory=list)  # released before launch; free once processed

    @property
    def num_tokens(self) -> int:
        return sum(self.job.extend_lens)


def _sampling_info(reqs: list[Req], vocab_size: int, device: torch.device) -> SamplingBatchInfo:
    sps = [r.sampling_params for r in reqs]
    return SamplingBatchInfo.build([p.temperature for p in sps], [p.top_p for p in sps], [p.top_k for p in sps],
                                   [p.min_p for p in sps], [r.seed for r in reqs], vocab_size, device)


def _penalties(reqs: list[Req], outputs_before: list[int], reset: list[bool], vocab_size: int,
               eos_ids: list[int], device: torch.device) -> PenaltyInfo | None:
    sps = [r.sampling_params for r in reqs]
    counts_active = any(p.has_penalties for p in sps)
    has_bias = any(p.logit_bias for p in sps)
    min_mask = [n < p.min_new_tokens for n, p in zip(outputs_before, sps)]
    if not (counts_active or has_bias or any(min_mask)):
        return None
    f32 = dict(dtype=torch.float32, device=device)
    bias = None
    if has_bias:
        bias = torch.zeros((len(reqs), vocab_size), **f32)
        for i, p in enumerate(sps):
            for tok, val in (p.logit_bias or {}).items():
                bias[i, int(tok)] = val
    # min_new_tokens bans EOS, unless the request ignores EOS anyway
    banned = [list(p.stop_token_ids) + ([] if p.ignore_eos else eos_ids) for p in sps]
    return PenaltyInfo(
        frequency=torch.tensor([p.frequency_penalty for p in sps], **f32),
        presence=torch.tensor([p.presence_penalty for p in sps], **f32),
        repetition=torch.tensor([p.repetition_penalty for p in sps], **f32),
        logit_bias=bias,
        min_tokens_mask=torch.tensor(min_mask, dtype=torch.bool, device=device) if any(min_mask) else None,
        banned_ids=banned, counts_active=counts_active,
        reset_rows=[(r.req_pool_idx, list(r.output_ids)) for r, rs in zip(reqs, reset) if rs and r.sampling_params.has_penalties],
    )


def build_batch(mode: ForwardMode, reqs: list[Req], extend_lens: list[int], prefix_lens: list[int],
                out_cache_loc: torch.Tensor, samples: list[bool], vocab_size: int, eos_ids: list[int],
                device: torch.device, poison_rows: list[int]) -> ScheduleBatch:
    """Turn planned requests into a ScheduleBatch. For extend, each request computes
    `extend_lens[i]` tokens after `prefix_lens[i]`; `samples[i]` says whether its pass ends in a sample."""
    input_ids: list[int] | None = None
    tasks: list[InputLogprobTask] = []
    lp_reqs: list[Req] = []
    if mode == ForwardMode.EXTEND:
        input_ids, offset = [], 0
        for r, pre, ext in zip(reqs, prefix_lens, extend_lens):
            ids = r.all_ids()
            input_ids.extend(ids[pre:pre + ext])
            task = _input_logprob_task(r, pre, ext, offset, len(lp_reqs))
            if task is not None:
                tasks.append(task)
                lp_reqs.append(r)
            offset += ext
    sample_idx = [i for i, s in enumerate(samples) if s]
    sreqs = [reqs[i] for i in sample_idx]
    positions = [prefix_lens[i] + extend_lens[i] for i in sample_idx]
    # tokens sampled before this pass: a pass ending at position p samples output number p - prompt_len
    outputs_before = [p - len(r.origin_input_ids) for p, r in zip(positions, sreqs)]
    want_lp = any(r.return_logprob for r in sreqs)
    job = ForwardJob(
        mode=mode, rows=[r.req_pool_idx for r in reqs], prefix_lens=prefix_lens, extend_lens=extend_lens,
        input_ids=input_ids, out_cache_loc=out_cache_loc, sample_indices=sample_idx,
        sampling=_sampling_info(sreqs, vocab_size, device) if sreqs else None, sample_positions=positions,
        logprob_tops=[r.top_logprobs_num if r.return_logprob else -1 for r in sreqs] if want_lp else None,
        logprob_token_ids=[r.token_ids_logprob for r in sreqs] if want_lp else None,
        input_logprob_tasks=tasks,
        penalties=_penalties(sreqs, outputs_before, [mode == ForwardMode.EXTEND] * len(sreqs), vocab_size, eos_ids, device)
        if sreqs else None,
        poison_rows=poison_rows,
    )
    return ScheduleBatch(mode, reqs, sreqs, job, lp_reqs)


def _input_logprob_task(r: Req, prefix: int, ext: int, offset: int, index: int) -> InputLogprobTask | None:
    acc = r.input_logprobs
    if acc is None or acc.done:
        return None
    lo, hi = max(prefix, acc.rows_needed.start), min(prefix + ext, acc.rows_needed.stop)
    if lo >= hi:
        return None
    prompt = r.origin_input_ids
    return InputLogprobTask(req_index=index, first_row=lo, token_offset=offset + lo - prefix,
                            next_ids=prompt[lo + 1:hi + 1], top_k=r.top_logprobs_num, token_ids=r.token_ids_logprob)

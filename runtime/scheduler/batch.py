"""ScheduleBatch: the requests of one planned step and the ForwardJob that runs it.

A step is a list of ExtendSpans, one per request: positions [prefix_len, prefix_len +
extend_len) are computed (a decode step is spans of one position). A span whose end is the
request's last known position samples the next token; a middle prefill chunk samples nothing.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.runtime.grammar.mask import GrammarMask
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.sampling.sampler import SamplingBatchInfo
from tandem.runtime.scheduler.forward_worker import (ForwardJob, InputLogprobTask, PenaltyInfo, PromptRowsTask,
                                                      SpecInfo)
from tandem.runtime.scheduler.request import Req


class BatchTensorCache:
    """A [B, V] tensor made from one object per row, reused while every row holds the same object.
    Requests keep their logit_bias arrays and their Req for life, so a row's part of the tensor is a
    function of that object; the key holds the objects themselves, so none can be freed and its id
    reused. Built once per batch composition (as SGLang builds them when a batch forms), not per
    step: a full-vocabulary logit_bias or stop list is 49k entries a row."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] = ()
        self._tensor: torch.Tensor | None = None

    def get(self, key: tuple[object, ...], build: Callable[[], torch.Tensor]) -> torch.Tensor:
        if len(key) != len(self._key) or any(a is not b for a, b in zip(key, self._key)):  # () after drop
            self._tensor, self._key = build(), key
        return self._tensor  # type: ignore[return-value]  # set whenever _key is not ()

    def drop(self) -> None:
        """No row needs it: let the finished requests' objects and the tensor go."""
        self._tensor, self._key = None, ()


@dataclass(frozen=True)
class BatchContext:
    """What batch building needs to know about the model and the device, and what it keeps from step
    to step: the last logit_bias and min_new_tokens ban tensors."""

    vocab_size: int
    eos_ids: tuple[int, ...]
    device: torch.device
    logit_bias: BatchTensorCache = field(default_factory=BatchTensorCache, compare=False, repr=False)
    bans: BatchTensorCache = field(default_factory=BatchTensorCache, compare=False, repr=False)


@dataclass
class ExtendSpan:
    req: Req
    prefix_len: int
    extend_len: int
    out_cache_loc: torch.Tensor  # KV slots of the new positions (a verify reads them from the row)
    samples: bool  # the span ends at the request's last known position
    drafts: int = 0  # verify: most drafts checked after the last token (prefix_len is then unknown: -1)

    @property
    def max_new_tokens(self) -> int:
        """Most tokens this span can add to its request."""
        return 1 + self.drafts if self.samples else 0


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    spans: list[ExtendSpan]
    job: ForwardJob
    step_id: int = 0  # set when launched
    future: Future | None = None  # set when launched

    @property
    def reqs(self) -> list[Req]:
        return [s.req for s in self.spans]

    @property
    def sampling_reqs(self) -> list[Req]:
        """The requests whose pass samples a token, in result order."""
        return [s.req for s in self.spans if s.samples]

    @property
    def num_tokens(self) -> int:
        return sum(s.extend_len for s in self.spans)

    def cache_hits(self, continued: Req | None) -> int:
        """Prompt tokens this step's new requests found in the prefix cache, as SGLang's PrefillAdder
        logs #cached-token: a continued chunk's prefix is its own earlier chunks, not a hit."""
        return sum(s.prefix_len for s in self.spans if s.req is not continued)

    def mark_processed(self) -> None:
        """The step's results are applied: its tokens are no longer in flight."""
        for s in self.spans:
            s.req.outputs_in_flight -= s.max_new_tokens


def build_batch(mode: ForwardMode, spans: list[ExtendSpan], ctx: BatchContext,
                spec: SpecInfo | None = None) -> ScheduleBatch:
    """`spec` (speculative servers): per sampling request, what the worker needs to verify and draft."""
    reqs = [s.req for s in spans]
    input_ids: list[int] | None = None
    lp_tasks: list[InputLogprobTask] = []
    hidden_tasks: list[PromptRowsTask] = []
    if mode == ForwardMode.EXTEND:
        input_ids, offset = [], 0
        for i, s in enumerate(spans):
            input_ids.extend(s.req.all_ids()[s.prefix_len:s.prefix_len + s.extend_len])
            if (task := _input_logprob_task(i, s, offset)) is not None:
                lp_tasks.append(task)
            if (rows := _prompt_hidden_task(i, s, offset)) is not None:
                hidden_tasks.append(rows)
            offset += s.extend_len
    sample_idx = [i for i, s in enumerate(spans) if s.samples]
    sreqs = [reqs[i] for i in sample_idx]
    if mode == ForwardMode.TARGET_VERIFY:  # the worker knows the positions; the output count is
        positions = []  # exact where it matters (min_new_tokens: no drafts until it is reached)
        outputs_before = [len(r.output_ids) + min(r.outputs_in_flight, 1) for r in sreqs]
    else:
        positions = [spans[i].prefix_len + spans[i].extend_len for i in sample_idx]
        # tokens sampled before this pass: a pass ending at position p samples output number p - prompt_len
        outputs_before = [p - len(r.origin_input_ids) for p, r in zip(positions, sreqs)]
    want_lp = any(r.return_logprob for r in sreqs)
    want_hidden = any(r.return_hidden_states for r in sreqs)
    job = ForwardJob(
        mode=mode, rows=[r.kv.req_pool_idx for r in reqs], prefix_lens=[s.prefix_len for s in spans],
        extend_lens=[s.extend_len for s in spans], input_ids=input_ids,
        out_cache_loc=torch.cat([s.out_cache_loc for s in spans]), sample_indices=sample_idx,
        sampling=_sampling_info(sreqs, ctx) if sreqs else None, sample_positions=positions,
        top_logprobs_nums=[r.logprob.top_logprobs_num if r.return_logprob else -1 for r in sreqs] if want_lp else None,
        token_ids_logprob=[r.logprob.token_ids_logprob for r in sreqs] if want_lp else None,
        return_hidden=[r.return_hidden_states for r in sreqs] if want_hidden else None,
        input_logprob_tasks=lp_tasks, prompt_hidden_tasks=hidden_tasks,
        penalties=_penalties(sreqs, outputs_before, ctx) if sreqs else None,
        grammar_mask=_grammar_mask(sreqs), spec=spec,
        forced_ids=_forced_ids(sreqs, outputs_before),
    )
    return ScheduleBatch(mode, spans, job)


def _forced_ids(reqs: list[Req], outputs_before: list[int]) -> list[int] | None:
    """Strict thinking (max_thinking_tokens): the think-end token a request must emit next, or -1."""
    forced = [-1 if (k := r.sampling_params.max_thinking_tokens) is None or r.think is None
              else r.think.forced_token(k, n) for r, n in zip(reqs, outputs_before)]
    return forced if any(t >= 0 for t in forced) else None


def _grammar_mask(sampling_reqs: list[Req]) -> GrammarMask | None:
    rows = [i for i, r in enumerate(sampling_reqs) if r.sampling_params.constraint is not None]
    return GrammarMask(rows) if rows else None


def _sampling_info(reqs: list[Req], ctx: BatchContext) -> SamplingBatchInfo:
    sps = [r.sampling_params for r in reqs]
    return SamplingBatchInfo.build([p.temperature for p in sps], [p.top_p for p in sps], [p.top_k for p in sps],
                                   [p.min_p for p in sps], [r.seed for r in reqs], ctx.vocab_size, ctx.device)


def _penalties(reqs: list[Req], outputs_before: list[int], ctx: BatchContext) -> PenaltyInfo | None:
    sps = [r.sampling_params for r in reqs]
    counts_active = any(p.has_penalties for p in sps)
    has_bias = any(r.logit_bias is not None for r in reqs)
    under_min = [n < p.min_new_tokens for n, p in zip(outputs_before, sps)]
    has_bans = any(under_min)
    if not has_bias:
        ctx.logit_bias.drop()
    if not has_bans:
        ctx.bans.drop()
    if not (counts_active or has_bias or has_bans):
        return None
    f32 = dict(dtype=torch.float32, device=ctx.device)
    bias = ctx.logit_bias.get(tuple(r.logit_bias for r in reqs), lambda: _logit_bias(reqs, ctx)) if has_bias else None
    ban_key = tuple(r if under else None for r, under in zip(reqs, under_min))
    bans = ctx.bans.get(ban_key, lambda: _ban_mask(reqs, under_min, ctx)) if has_bans else None
    return PenaltyInfo(
        frequency=torch.tensor([p.frequency_penalty for p in sps], **f32),
        presence=torch.tensor([p.presence_penalty for p in sps], **f32),
        repetition=torch.tensor([p.repetition_penalty for p in sps], **f32),
        logit_bias=bias, ban_mask=bans, counts_active=counts_active,
    )


def _ban_mask(reqs: list[Req], under_min: list[bool], ctx: BatchContext) -> torch.Tensor:
    """[B, V] bool: the ids a row still under min_new_tokens may not sample, its stop_token_ids and
    the EOS ids; rows past it ban nothing. EOS is banned even under ignore_eos (SGLang's): the first
    tokens are real ones."""
    mask = torch.zeros((len(reqs), ctx.vocab_size), dtype=torch.bool)
    for i, (r, under) in enumerate(zip(reqs, under_min)):
        if under:
            mask[i, torch.tensor([*r.sampling_params.stop_token_ids, *ctx.eos_ids], dtype=torch.int64)] = True
    return mask.to(ctx.device)


def _logit_bias(reqs: list[Req], ctx: BatchContext) -> torch.Tensor:
    """[B, V] float32: each request's bias scattered in one index_put for the whole batch."""
    biased = [(i, r.logit_bias) for i, r in enumerate(reqs) if r.logit_bias is not None]
    rows = np.concatenate([np.full(len(ids), i, np.int64) for i, (ids, _) in biased])
    ids = np.concatenate([ids for _, (ids, _) in biased])
    vals = np.concatenate([vals for _, (_, vals) in biased])
    bias = torch.zeros((len(reqs), ctx.vocab_size), dtype=torch.float32)
    bias[torch.from_numpy(rows), torch.from_numpy(ids)] = torch.from_numpy(vals)
    return bias.to(ctx.device)


def _input_logprob_task(index: int, s: ExtendSpan, offset: int) -> InputLogprobTask | None:
    acc = s.req.input_logprobs
    if acc is None or acc.done:
        return None
    lo, hi = max(s.prefix_len, acc.next_row), min(s.prefix_len + s.extend_len, acc.rows_needed.stop)
    if lo >= hi:
        return None
    prompt, lp = s.req.origin_input_ids, s.req.logprob
    return InputLogprobTask(req_index=index, first_pos=lo, token_offset=offset + lo - s.prefix_len, n=hi - lo,
                            next_ids=prompt[lo + 1:hi + 1], top_logprobs_num=lp.top_logprobs_num,
                            token_ids_logprob=lp.token_ids_logprob)


def _prompt_hidden_task(index: int, s: ExtendSpan, offset: int) -> PromptRowsTask | None:
    req = s.req
    if not req.needs_prompt_hidden:
        return None
    lo, hi = max(s.prefix_len, req.prompt_hidden_next), min(s.prefix_len + s.extend_len, req.prompt_hidden_stop)
    if lo >= hi:
        return None
    return PromptRowsTask(req_index=index, first_pos=lo, token_offset=offset + lo - s.prefix_len, n=hi - lo)

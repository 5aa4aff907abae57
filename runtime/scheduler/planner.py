"""Planner: what the next step runs, over the waiting queue, the running set and the chunked request.

Prefill first (chunked prefill through PrefillAdder); a decode step over the running requests
otherwise. Retraction happens here, when the next decode step does not fit in KV memory (or
every N decode steps under TANDEM_TEST_RETRACT): the victim's KV goes back to the tree and it
is requeued, to re-prefill its prompt + output later (mostly from the cache). The planner never
finishes a request itself: what it gives up on comes back in `Plan.aborted`, and what it
retracts in `Plan.retracted`, for SchedulerCore to apply.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.ipc.messages import FinishReason
from tandem.runtime.envs import envs
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.scheduler.batch import BatchContext, ExtendSpan, ScheduleBatch, build_batch
from tandem.runtime.scheduler.forward_worker import SpecInfo
from tandem.runtime.scheduler.kv_manager import KVManager
from tandem.runtime.scheduler.policy import SchedulePolicy
from tandem.runtime.scheduler.prefill_adder import ChunkedReq, PrefillAdder, decode_reserve
from tandem.runtime.scheduler.request import Req
from tandem.runtime.server_args import ServerArgs

if TYPE_CHECKING:
    from tandem.runtime.model.runner import ModelRunner

logger = logging.getLogger("tandem.scheduler")


@dataclass(frozen=True)
class PlannerConfig:
    context_len: int
    max_total_tokens: int
    max_running_requests: int
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048  # new tokens per prefill step; <= 0: only max_prefill_tokens caps it
    max_queued_requests: int | None = None
    request_timeout: float | None = None
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False  # SGLang's flag: smaller priority values run first
    priority_preemption: bool = False
    # an arrival preempts a running request only when more urgent by MORE than this (SGLang's default)
    priority_scheduling_preemption_threshold: int = 10
    abort_on_priority_when_disabled: bool = False  # SGLang's flag: a priority without priority scheduling is a 503
    force_retract_every: int = 0  # TANDEM_TEST_RETRACT: retract one request every N decode steps
    speculative_num_drafts: int = 0  # drafts per verify; 0: plain decoding
    speculative_disable_batch_size: int | None = None  # more running requests than this: no drafts
    speculative_draft_ahead: int = 0  # positions past a verify that the drafter writes KV for (STANDALONE)

    @staticmethod
    def from_args(args: ServerArgs, runner: ModelRunner) -> "PlannerConfig":
        """The server's settings and the model's limits (context, KV slots, request rows)."""
        spec = args.speculative_algorithm
        return PlannerConfig(
            context_len=runner.context_len, max_total_tokens=runner.max_total_tokens,
            max_running_requests=runner.max_running_requests, max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size, max_queued_requests=args.max_queued_requests,
            request_timeout=args.request_timeout, schedule_policy=args.schedule_policy,
            enable_priority_scheduling=args.enable_priority_scheduling,
            priority_preemption=not args.disable_priority_preemption,
            schedule_low_priority_values_first=args.schedule_low_priority_values_first,
            priority_scheduling_preemption_threshold=args.priority_scheduling_preemption_threshold,
            abort_on_priority_when_disabled=args.abort_on_priority_when_disabled,
            force_retract_every=envs.TEST_RETRACT_INTERVAL.get() if envs.TEST_RETRACT.get() else 0,
            speculative_num_drafts=args.speculative_num_draft_tokens - 1 if spec else 0,
            speculative_disable_batch_size=args.speculative_disable_batch_size,
            # the draft model writes KV for its K - 1 chained inputs past the verify's last position
            speculative_draft_ahead=args.speculative_num_draft_tokens - 1 if spec == "STANDALONE" else 0)


@dataclass
class Plan:
    batch: ScheduleBatch | None
    aborted: list[tuple[Req, FinishReason]] = field(default_factory=list)  # for the core to finish
    retracted: list[Req] = field(default_factory=list)  # back in the waiting queue


_NO_SLOTS = torch.empty(0, dtype=torch.int64)  # a verify's slots are read from the row by the worker
_OOM = FinishReason(type="abort", status_code=500, err_type="OutOfMemory",
                    message="out of KV memory after retracting every other request")


class Planner:
    def __init__(self, cfg: PlannerConfig, kv: KVManager, ctx: BatchContext) -> None:
        self.cfg = cfg
        self.kv = kv
        self.ctx = ctx
        self.policy = SchedulePolicy(cfg.schedule_policy, cfg.enable_priority_scheduling, kv.tree,
                                     cfg.schedule_low_priority_values_first)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: ChunkedReq | None = None
        self._decode_steps = 0
        self.num_retractions = 0
        self._retracted: list[Req] = []  # requeued while planning this step (Plan.retracted)
        self.hold_waiting = False  # a weight update waits for the running requests: admit no new one

    # -- queue bookkeeping ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    @property
    def num_running(self) -> int:
        """Requests holding KV: decoding ones plus the one in chunked prefill."""
        return len(self.running) + (self.chunked is not None)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    # -- planning --------------------------------------------------------------------------------------
    def next_batch(self) -> Plan:
        batch = self._plan_prefill()
        plan = Plan(batch) if batch is not None else self._plan_decode()
        plan.retracted, self._retracted = self._retracted, []
        return plan

    def _plan_prefill(self) -> ScheduleBatch | None:
        if (not self.waiting or self.hold_waiting) and self.chunked is None:
            return None
        budget, chunk = self.cfg.max_prefill_tokens, self.cfg.chunked_prefill_size
        adder = PrefillAdder(self.kv, min(budget, chunk) if chunk > 0 else budget, self.running)
        if self.chunked is not None and not adder.continue_chunked(self.chunked):
            return None  # memory is full; decode steps free it up over time
        self.policy.sort(self.waiting)
        for req in list(self.waiting):
            if adder.closed:
                break
            if self.num_running + len(adder.admitted) >= self.cfg.max_running_requests and not self._preempt_for(req, adder):
                break
            if not adder.add(req):
                break
            self.waiting.remove(req)
        if not adder.spans:
            return None
        self.chunked = adder.chunked
        sampling = [s.req for s in adder.spans if s.samples]
        self.running.extend(sampling)
        spec = self._spec_prefill(sampling)
        for req in sampling:
            req.outputs_in_flight += 1
        return build_batch(ForwardMode.EXTEND, adder.spans, self.ctx, spec)

    def _plan_decode(self) -> Plan:
        reqs = [r for r in self.running if self._planned_outputs(r) < r.sampling_params.max_new_tokens]
        if not reqs:
            return Plan(None)
        self._decode_steps += 1
        every = self.cfg.force_retract_every
        if every and len(reqs) > 1 and self._decode_steps % every == 0:
            self._retract(self.policy.retract_order(reqs)[0], reqs)
        if self.cfg.speculative_num_drafts:
            return self._plan_verify(reqs)
        while self.kv.available_tokens() < self.kv.decode_need(reqs):
            if self.kv.drop_decode_runs(reqs):
                continue
            if (gave_up := self._make_room(reqs)) is not None:
                return gave_up
        slots = self.kv.alloc_decode(reqs)  # one position each, computed by this step: committed
        spans = []
        for i, r in enumerate(reqs):  # the step computes the position just committed
            spans.append(ExtendSpan(r, r.kv.committed_len - 1, 1, slots[i:i + 1], samples=True))
            r.outputs_in_flight += 1
        return Plan(build_batch(ForwardMode.DECODE, spans, self.ctx))

    # -- speculative decoding ------------------------------------------------------------------------
    def _plan_verify(self, reqs: list[Req]) -> Plan:
        """A verify step: each request checks up to its drafts after its last token. Where that
        token sits depends on the step in flight, so slots are reserved up to the furthest
        position this step (and the drafter after it) can reach; the worker reads the real one."""
        spec = self._spec_active(len(reqs))
        while True:
            drafts = {id(r): self._max_drafts(r) if spec else 0 for r in reqs}
            need = {id(r): self._reserve_upto(r, drafts[id(r)]) - r.kv.alloc_len for r in reqs}
            if self.kv.available_tokens() >= sum(max(n, 0) for n in need.values()):
                break
            if (gave_up := self._make_room(reqs)) is not None:
                return gave_up
        spans = []
        for r in reqs:
            self.kv.reserve(r, self._reserve_upto(r, drafts[id(r)]))
            spans.append(ExtendSpan(r, -1, 1 + drafts[id(r)], _NO_SLOTS, samples=True, drafts=drafts[id(r)]))
        info = SpecInfo(max_drafts=[drafts[id(r)] for r in reqs], make_drafts=[spec and self._drafts_ok(r) for r in reqs],
                        pos_limits=[r.max_total_len() for r in reqs], histories=None)
        batch = build_batch(ForwardMode.TARGET_VERIFY, spans, self.ctx, info)
        for r in reqs:
            r.outputs_in_flight += 1 + drafts[id(r)]
        return Plan(batch)

    def _spec_active(self, batch_size: int) -> bool:
        limit = self.cfg.speculative_disable_batch_size
        return limit is None or batch_size <= limit

    def _max_drafts(self, req: Req) -> int:
        """Drafts one verify may check: none for what a draft run cannot honour token by token
        (penalties, grammars, hidden states, min_new_tokens not reached), and never past max_new_tokens."""
        sp = req.sampling_params
        if not self._drafts_ok(req):
            return 0
        if len(req.output_ids) + min(req.outputs_in_flight, 1) < sp.min_new_tokens:
            return 0
        room = sp.max_new_tokens - self._planned_outputs(req) - 1
        return max(0, min(self.cfg.speculative_num_drafts, room))

    def _reserve_upto(self, req: Req, drafts: int) -> int:
        """Slots up to the furthest position this verify and the drafts after it can touch."""
        start = req.seq_len - 1 + req.outputs_in_flight  # the latest the last token can sit
        return min(start + 1 + drafts + self.cfg.speculative_draft_ahead, req.max_total_len())

    def _spec_prefill(self, sampling: list[Req]) -> SpecInfo | None:
        if not self.cfg.speculative_num_drafts or not sampling:
            return None
        make = [self._spec_active(len(self.running)) and self._drafts_ok(r) and self._reserve_draft_ahead(r)
                for r in sampling]
        return SpecInfo(max_drafts=[0] * len(sampling), make_drafts=make,
                        pos_limits=[r.max_total_len() for r in sampling], histories=[r.all_ids() for r in sampling])

    def _reserve_draft_ahead(self, req: Req) -> bool:
        """A draft model drafting right after the prefill writes KV past the prompt: reserve it."""
        ahead = self.cfg.speculative_draft_ahead
        return not ahead or self.kv.reserve(req, min(req.seq_len + ahead, req.max_total_len())) is not None

    @staticmethod
    def _drafts_ok(req: Req) -> bool:
        sp = req.sampling_params
        return not (sp.has_penalties or req.grammar is not None or req.return_hidden_states
                    or sp.max_thinking_tokens is not None)

    def _preempt_for(self, req: Req, adder: PrefillAdder) -> bool:
        """With priority scheduling (unless --disable-priority-preemption), an arrival more urgent
        than running requests by more than --priority-scheduling-preemption-threshold retracts the
        least urgent of them, as many as it needs to fit, as SGLang's preempt_to_schedule; none
        when even those would not make room (a retraction that admits nobody only costs work)."""
        cfg = self.cfg
        if not (cfg.priority_preemption and cfg.enable_priority_scheduling and self.running):
            return False
        urgency = self.policy.urgency
        needed = adder.shortfall(req, len(self.kv.match_prefix(req)[0]))
        short = needed
        victims: list[Req] = []
        for victim in self.policy.retract_order(self.running):
            if urgency(req) - urgency(victim) <= cfg.priority_scheduling_preemption_threshold:
                break  # strictly more than the threshold, as SGLang's
            victims.append(victim)
            # what their release really frees: a path a request left running shares stays locked
            short = needed - self.kv.releasable(victims) - decode_reserve(victims)
            if short <= 0:
                break
        if not victims or short > 0:
            return False
        for victim in victims:
            self._retract(victim, [victim])
        adder.reserve -= decode_reserve(victims)  # they no longer decode this round
        return True

    @staticmethod
    def _planned_outputs(req: Req) -> int:
        """Most tokens the request can have once every planned step ran."""
        return len(req.output_ids) + req.outputs_in_flight

    def _make_room(self, reqs: list[Req]) -> Plan | None:
        """KV memory is short for a decode step over `reqs`. The chunked prompt goes back to the
        queue first (it has produced nothing; most of its prefill stays in the tree, and it is
        admitted again only once its whole prompt fits), then the first of `reqs` in retract
        order. With one left, requests whose last token is in flight free their KV once it is
        processed (the step waits); only a request alone in KV memory is given up on. None: room
        was made, try again."""
        if self.chunked is not None:
            chunked, self.chunked = self.chunked.req, None
            self._requeue(chunked)
        elif len(reqs) > 1:
            self._retract(self.policy.retract_order(reqs)[0], reqs)
        elif len(self.running) > len(reqs):
            return Plan(None)
        else:
            return Plan(None, [(reqs[0], _OOM)])
        return None

    def retract_all(self) -> list[Req]:
        """Every request holding KV back to the waiting queue, its output kept."""
        reqs = self.running + ([self.chunked.req] if self.chunked is not None else [])
        self.running, self.chunked = [], None
        for req in reqs:
            self._requeue(req)
        self._retracted = []  # returned here, not in the next Plan
        return reqs

    def _retract(self, req: Req, reqs: list[Req]) -> None:
        self.running.remove(req)
        if req in reqs:
            reqs.remove(req)
        self._requeue(req)

    def _requeue(self, req: Req) -> None:
        """Give a request's KV back (its computed prefix to the tree) and queue it again."""
        self.kv.release(req)
        req.retract_count += 1
        self.num_retractions += 1
        self.waiting.append(req)
        self._retracted.append(req)
        logger.debug("retracted %s after %d tokens", req.rid, len(req.output_ids))

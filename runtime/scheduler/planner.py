"""Planner: the waiting queue, the running set, the chunked request, and what the next step runs.

Prefill first (chunked prefill through PrefillAdder); a decode step over the running requests
otherwise. Retraction happens here, when the next decode step does not fit in KV memory (or
every N decode steps under TANDEM_TEST_RETRACT): the victim's KV goes back to the tree and it
is requeued, to re-prefill its prompt + output later (mostly from the cache). The planner never
finishes a request itself: what it gives up on comes back in `Plan.aborted`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tandem.ipc.messages import FinishReason
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.scheduler.batch import BatchContext, ExtendSpan, ScheduleBatch, build_batch
from tandem.runtime.scheduler.kv_manager import KVManager
from tandem.runtime.scheduler.policy import SchedulePolicy
from tandem.runtime.scheduler.prefill_adder import ChunkedReq, PrefillAdder
from tandem.runtime.scheduler.request import Req

logger = logging.getLogger("tandem.scheduler")
PREEMPTION_THRESHOLD = 10  # priority gap that lets an arrival preempt a running request (SGLang's default)


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
    priority_preemption: bool = False
    force_retract_every: int = 0  # TANDEM_TEST_RETRACT: retract one request every N decode steps


@dataclass
class Plan:
    batch: ScheduleBatch | None
    aborted: list[tuple[Req, FinishReason]] = field(default_factory=list)  # for the scheduler to finish


_OOM = FinishReason(type="abort", status_code=500, err_type="OutOfMemory",
                    message="out of KV memory after retracting every other request")


class Planner:
    def __init__(self, cfg: PlannerConfig, kv: KVManager, ctx: BatchContext) -> None:
        self.cfg = cfg
        self.kv = kv
        self.ctx = ctx
        self.policy = SchedulePolicy(cfg.schedule_policy, cfg.enable_priority_scheduling, kv.tree)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: ChunkedReq | None = None
        self._decode_steps = 0
        self.num_retractions = 0

    # -- queue bookkeeping ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    @property
    def num_running(self) -> int:
        """Requests holding KV: decoding ones plus the one in chunked prefill."""
        return len(self.running) + (self.chunked is not None)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def admission_error(self, req: Req) -> FinishReason | None:
        """Checks that need the scheduler's numbers; the tokenizer manager already did the rest."""
        limit = self.cfg.context_len
        if req.max_total_len() > limit:
            return FinishReason(type="abort", status_code=400, err_type="BadRequest",
                                message=f"prompt ({len(req.origin_input_ids)} tokens) + max_new_tokens "
                                        f"({req.sampling_params.max_new_tokens}) exceeds the context length ({limit})")
        if req.max_total_len() > self.cfg.max_total_tokens:
            return FinishReason(type="abort", status_code=400, err_type="BadRequest",
                                message=f"request needs {req.max_total_len()} KV slots; the server has "
                                        f"{self.cfg.max_total_tokens}")
        cap = self.cfg.max_queued_requests
        if cap is not None and len(self.waiting) >= cap:
            return FinishReason(type="abort", status_code=503, err_type="ServiceUnavailable",
                                message=f"the waiting queue is full ({cap} requests)")
        return None

    def take(self, group_prefixes: list[str], abort_all: bool) -> list[Req]:
        """Remove and return every choice of the given groups (internal group prefixes), or
        everything; one pass over each queue however many requests match."""
        if abort_all:
            prefixes: tuple[str, ...] = ("",)
        else:
            prefixes = tuple(p for p in group_prefixes if p)
            if not prefixes:
                return []
        taken = [r for r in self.waiting + self.running if r.rid.startswith(prefixes)]
        if taken:
            gone = set(map(id, taken))
            self.waiting = [r for r in self.waiting if id(r) not in gone]
            self.running = [r for r in self.running if id(r) not in gone]
        if self.chunked is not None and self.chunked.req.rid.startswith(prefixes):
            taken.append(self.chunked.req)
            self.chunked = None
        return taken

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is not None and self.chunked.req is req:
            self.chunked = None

    def expired(self, now: float) -> list[Req]:
        """Waiting requests older than --request-timeout."""
        timeout = self.cfg.request_timeout
        if not timeout:
            return []
        return [r for r in self.waiting if now - r.created_monotonic > timeout]

    # -- planning --------------------------------------------------------------------------------------
    def next_batch(self) -> Plan:
        batch = self._plan_prefill()
        if batch is not None:
            return Plan(batch)
        return self._plan_decode()

    def _plan_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        budget, chunk = self.cfg.max_prefill_tokens, self.cfg.chunked_prefill_size
        adder = PrefillAdder(self.kv, min(budget, chunk) if chunk > 0 else budget, self.running)
        if self.chunked is not None and not adder.continue_chunked(self.chunked):
            return None  # memory is full; decode steps free it up over time
        self.policy.sort(self.waiting)
        for req in list(self.waiting):
            if adder.closed:
                break
            if self.num_running + len(adder.admitted) >= self.cfg.max_running_requests and not self._preempt_for(req):
                break
            if not adder.add(req):
                break
            self.waiting.remove(req)
        if not adder.spans:
            return None
        self.chunked = adder.chunked
        self.running.extend(s.req for s in adder.spans if s.samples)
        return build_batch(ForwardMode.EXTEND, adder.spans, self.ctx)

    def _plan_decode(self) -> Plan:
        reqs = [r for r in self.running if self._planned_outputs(r) < r.sampling_params.max_new_tokens]
        if not reqs:
            return Plan(None)
        self._decode_steps += 1
        every = self.cfg.force_retract_every
        if every and len(reqs) > 1 and self._decode_steps % every == 0:
            self._retract(self.policy.retract_order(reqs)[0], reqs)
        while self.kv.available_tokens() < len(reqs):
            victim = self.policy.retract_order(reqs)[0]
            if len(reqs) == 1:
                return Plan(None, [(victim, _OOM)])
            self._retract(victim, reqs)
        slots = self.kv.alloc_slots(len(reqs))
        assert slots is not None
        spans = []
        for i, r in enumerate(reqs):
            spans.append(ExtendSpan(r, r.kv_alloc_len, 1, slots[i:i + 1], samples=True))
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        positions = torch.tensor([r.kv_alloc_len for r in reqs], dtype=torch.int64)
        self.kv.req_to_token[rows, positions] = slots.to(self.kv.req_to_token.device)
        for r in reqs:
            r.kv_alloc_len += 1
        return Plan(build_batch(ForwardMode.DECODE, spans, self.ctx))

    def _preempt_for(self, req: Req) -> bool:
        """--priority-preemption: a much more urgent arrival retracts the least urgent running request."""
        cfg = self.cfg
        if not (cfg.priority_preemption and cfg.enable_priority_scheduling and self.running):
            return False
        victim = self.policy.retract_order(self.running)[0]
        if req.priority - victim.priority < PREEMPTION_THRESHOLD:
            return False
        self._retract(victim, [victim])
        return True

    @staticmethod
    def _planned_outputs(req: Req) -> int:
        """Tokens the request will have sampled once every planned step ran."""
        return req.kv_alloc_len - len(req.origin_input_ids) + 1

    def _retract(self, req: Req, reqs: list[Req]) -> None:
        self.kv.release(req)
        self.running.remove(req)
        if req in reqs:
            reqs.remove(req)
        req.retract_count += 1
        self.num_retractions += 1
        self.waiting.append(req)
        logger.debug("retracted %s after %d tokens", req.rid, len(req.output_ids))

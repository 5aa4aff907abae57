"""Planner: the waiting queue and the running set, and what the next step runs.

Prefill first (with chunked prefill); a decode step over the running requests otherwise.
Retraction happens here, when the next decode step does not fit in KV memory (or every N
decode steps under TANDEM_TEST_RETRACT).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from tandem.ipc.messages import FinishReason
from tandem.runtime.envs import envs
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.scheduler.batch import ScheduleBatch, build_batch
from tandem.runtime.scheduler.kv_manager import KVManager
from tandem.runtime.scheduler.policy import SchedulePolicy
from tandem.runtime.scheduler.request import Req
from tandem.runtime.server_args import ServerArgs

logger = logging.getLogger("tandem.scheduler")
NEW_TOKEN_RATIO = 0.3  # share of a request's max_new_tokens held back for its decode when admitting
_MAX_RESERVE_PER_REQ = 4096
PREEMPTION_THRESHOLD = 10  # priority gap that lets an arrival preempt a running request (SGLang's default)


class Planner:
    def __init__(self, args: ServerArgs, runner: ModelRunner, kv: KVManager, eos_ids: list[int],
                 finish: Callable[[Req, FinishReason], None]) -> None:
        self.args = args
        self.finish = finish  # ends a request the planner gives up on (out of memory)
        self.runner = runner
        self.kv = kv
        self.eos_ids = eos_ids
        self.policy = SchedulePolicy(args.schedule_policy, args.enable_priority_scheduling, kv.tree)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self._poison_rows: list[int] = []
        self._decode_steps = 0
        self.force_retract_every = envs.TEST_RETRACT_INTERVAL.get() if envs.TEST_RETRACT.get() else 0
        self.num_retractions = 0

    # -- queue bookkeeping ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def idle(self) -> bool:
        return not self.has_work()

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def admission_error(self, req: Req) -> FinishReason | None:
        """Checks that need the scheduler's numbers; the tokenizer manager already did the rest."""
        limit = self.runner.context_len
        if req.max_total_len() > limit:
            return FinishReason(type="abort", status_code=400, err_type="BadRequest",
                                message=f"prompt ({len(req.origin_input_ids)} tokens) + max_new_tokens "
                                        f"({req.sampling_params.max_new_tokens}) exceeds the context length ({limit})")
        if req.max_total_len() > self.runner.max_total_tokens:
            return FinishReason(type="abort", status_code=400, err_type="BadRequest",
                                message=f"request needs {req.max_total_len()} KV slots; the server has "
                                        f"{self.runner.max_total_tokens}")
        cap = self.args.max_queued_requests
        if cap is not None and len(self.waiting) >= cap:
            return FinishReason(type="abort", status_code=503, err_type="ServiceUnavailable",
                                message=f"the waiting queue is full ({cap} requests)")
        return None

    def find(self, rid: str, abort_all: bool) -> list[Req]:
        """Requests whose rid starts with `rid` (n>1 children share their parent's rid as prefix)."""
        pool = self.waiting + self.running + ([self.chunked_req] if self.chunked_req else [])
        if abort_all:
            return pool
        return [r for r in pool if rid and r.rid.startswith(rid)]

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None

    def poison_later(self, row: int) -> None:
        self._poison_rows.append(row)

    def expire_timeouts(self, finish: Callable[[Req, FinishReason], None]) -> None:
        timeout = self.args.request_timeout
        if not timeout or not self.waiting:
            return
        now = time.monotonic()
        for req in [r for r in self.waiting if now - r.created_monotonic > timeout]:
            finish(req, FinishReason(type="abort", status_code=503, err_type="ServiceUnavailable",
                                     message=f"request waited longer than --request-timeout ({timeout} s)"))

    # -- planning --------------------------------------------------------------------------------------
    def next_batch(self) -> ScheduleBatch | None:
        return self._plan_prefill() or self._plan_decode()

    def _take_poison(self) -> list[int]:
        rows, self._poison_rows = self._poison_rows, []
        return rows

    def _reserve(self, reqs: list[Req]) -> int:
        return int(sum(min(r.sampling_params.max_new_tokens - len(r.output_ids), _MAX_RESERVE_PER_REQ)
                       for r in reqs) * NEW_TOKEN_RATIO)

    def _plan_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        budget = self.args.max_prefill_tokens
        chunk_cap = self.args.chunked_prefill_size if self.args.chunked_prefill_size > 0 else None
        reqs, prefix_lens, ext_lens, samples, slots = [], [], [], [], []
        if self.chunked_req is not None:
            req = self.chunked_req
            ext = min(req.seq_len - req.kv_alloc_len, chunk_cap or budget, budget)
            new_slots = self.kv.extend(req, ext) if ext else None
            if new_slots is None:
                return None  # memory is full; decode steps free it up over time
            self._admit(req, req.kv_alloc_len - ext, ext, reqs, prefix_lens, ext_lens, samples, slots, new_slots)
            budget -= ext
        self.policy.sort(self.waiting)
        reserve = self._reserve(self.running)
        admitted: list[Req] = []
        for req in list(self.waiting):
            if budget <= 0 or self.chunked_req is not None:
                break
            if len(self.running) + len(admitted) >= self.runner.max_running_requests and not self._preempt_for(req):
                break
            prefix_slots, node = self.kv.match_prefix(req)
            if not self.kv.start(req, prefix_slots, node):
                break
            ext = req.seq_len - req.kv_alloc_len
            if (chunk_cap and ext > chunk_cap) or ext > budget:
                ext = min(chunk_cap or budget, budget)
            reserve += self._reserve([req])
            # the decode reserve only matters when something else competes for the memory
            fits = self.kv.available_tokens() >= ext + (reserve if (self.running or admitted or reqs) else 0)
            new_slots = self.kv.extend(req, ext) if fits else None
            if new_slots is None:
                self.kv.release(req)
                break
            if req.retract_count == 0:
                req.cached_tokens = len(prefix_slots)
            self.waiting.remove(req)
            admitted.append(req)
            self._admit(req, len(prefix_slots), ext, reqs, prefix_lens, ext_lens, samples, slots, new_slots)
            budget -= ext
        if not reqs:
            return None
        return build_batch(ForwardMode.EXTEND, reqs, ext_lens, prefix_lens, torch.cat(slots), samples,
                           self.runner.config.vocab_size, self.eos_ids, self.runner.device, self._take_poison())

    def _admit(self, req: Req, prefix: int, ext: int, reqs, prefix_lens, ext_lens, samples, slots, new_slots) -> None:
        """Add one request's extend to the batch being planned and cache its prefix in the tree."""
        self.kv.cache_prefill(req)
        done = req.kv_alloc_len >= req.seq_len
        self.chunked_req = None if done else req
        if done:
            self.running.append(req)
        reqs.append(req)
        prefix_lens.append(prefix)
        ext_lens.append(ext)
        samples.append(done)
        slots.append(new_slots)

    def _plan_decode(self) -> ScheduleBatch | None:
        reqs = [r for r in self.running if self._planned_outputs(r) < r.sampling_params.max_new_tokens]
        if not reqs:
            return None
        self._decode_steps += 1
        if self.force_retract_every and len(reqs) > 1 and self._decode_steps % self.force_retract_every == 0:
            self._retract(self.policy.retract_order(reqs)[0], reqs)
        while self.kv.available_tokens() < len(reqs):
            victim = self.policy.retract_order(reqs)[0]
            if len(reqs) == 1:
                self.finish(victim, FinishReason(type="abort", status_code=500, err_type="OutOfMemory",
                                                 message="out of KV memory after retracting every other request"))
                return None
            self._retract(victim, reqs)
        new_slots = self.kv.alloc_slots(len(reqs))
        assert new_slots is not None
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        positions = torch.tensor([r.kv_alloc_len for r in reqs], dtype=torch.int64)
        self.kv.req_to_token[rows, positions] = new_slots.to(self.kv.req_to_token.device)
        prefix_lens = positions.tolist()
        for r in reqs:
            r.kv_alloc_len += 1
        return build_batch(ForwardMode.DECODE, reqs, [1] * len(reqs), prefix_lens, new_slots, [True] * len(reqs),
                           self.runner.config.vocab_size, self.eos_ids, self.runner.device, self._take_poison())

    def _preempt_for(self, req: Req) -> bool:
        """--priority-preemption: a much more urgent arrival retracts the least urgent running request."""
        if not (self.args.priority_preemption and self.args.enable_priority_scheduling and self.running):
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
        row = req.req_pool_idx
        self.kv.release(req)
        self.poison_later(row)  # type: ignore[arg-type]
        self.running.remove(req)
        if req in reqs:
            reqs.remove(req)
        req.retract_count += 1
        self.num_retractions += 1
        self.waiting.append(req)
        logger.debug("retracted %s after %d tokens", req.rid, len(req.output_ids))

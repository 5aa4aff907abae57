"""A process-free scheduler core for unit tests: planner, KV manager and request rows on CPU
tensors, driven step by step like the scheduler loop, with a fake model that "samples"
token `1000 + position` (so every output is predictable and retraction cannot change it)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.ipc.messages import FinishReason, LogprobParams, TokenizedGenerateReq
from tandem.runtime.cache.pools import ReqToTokenPool, TokenAllocator
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.sampling.penalties import PenaltyCounts
from tandem.runtime.scheduler.batch import BatchContext, ScheduleBatch
from tandem.runtime.scheduler.future_map import FutureMap, RelayPayload
from tandem.runtime.scheduler.kv_manager import KVManager
from tandem.runtime.scheduler.planner import Planner, PlannerConfig
from tandem.runtime.scheduler.req_rows import ReqRows
from tandem.runtime.scheduler.request import Req
from tandem.runtime.scheduler.result_processor import FinishChecker, apply_new_tokens

VOCAB = 4096
EOS = 2
CONTEXT = 256


def fake_token(position: int) -> int:
    return 1000 + position


@dataclass
class Core:
    planner: Planner
    kv: KVManager
    rows: ReqRows
    future_map: FutureMap
    penalty_counts: PenaltyCounts
    finished: list[Req] = field(default_factory=list)
    verify_runs: list[tuple[int, int]] = field(default_factory=list)  # (drafts allowed, tokens kept)
    _arrivals: itertools.count = field(default_factory=lambda: itertools.count(1))

    def add(self, rid: str, prompt: list[int] | int, max_new_tokens: int = 4, priority: int = 0,
            logprob: LogprobParams = LogprobParams(), return_hidden_states: bool = False, **sp) -> Req:
        arrival = next(self._arrivals)
        # distinct prompts unless a test gives its own (the radix cache shares equal prefixes)
        ids = list(range(10 * arrival, 10 * arrival + prompt)) if isinstance(prompt, int) else prompt
        msg = TokenizedGenerateReq(rid=rid, input_ids=np.asarray(ids, np.int32), stream=False,
                                   sampling_params=SamplingParams(**{"max_new_tokens": max_new_tokens,
                                                                     "ignore_eos": True, **sp}),
                                   priority=priority, logprob=logprob, return_hidden_states=return_hidden_states)
        req = Req.from_message(msg, arrival, default_seed=arrival)
        assert self.planner.admission_error(req) is None and self.planner.queue_error(req) is None
        self.planner.add(req)
        return req

    def plan(self) -> ScheduleBatch | None:
        """Plan and 'launch' the next step (the fake forward runs at processing)."""
        plan = self.planner.next_batch()
        for req, reason in plan.aborted:
            self.finish(req, reason)
        if plan.batch is not None:
            plan.batch.step_id = self.rows.on_launch()
            self._check_rows(plan.batch)
        return plan.batch

    def _check_rows(self, batch: ScheduleBatch) -> None:
        """The table rows a step reads hold exactly the slots the KV manager gave out."""
        if batch.mode == ForwardMode.TARGET_VERIFY:
            return  # its positions are known only once the step before it ran (see _verify)
        for span in batch.spans:
            row = self.kv.req_to_token[span.req.req_pool_idx]
            end = span.prefix_len + span.extend_len
            assert torch.equal(row[span.prefix_len:end], span.out_cache_loc)

    def process(self, batch: ScheduleBatch) -> None:
        """Run the fake forward for `batch`, then apply its results as the scheduler does."""
        if batch.mode == ForwardMode.TARGET_VERIFY:
            return self._verify(batch)
        job, sampled = batch.job, batch.sampling_reqs
        if job.input_ids is None:  # decode: the input tokens come from the future map (debug: checked)
            self.future_map.gather_bonus(torch.tensor(job.rows))
        positions = job.sample_positions
        rows = [job.rows[i] for i in job.sample_indices]
        if rows:
            self.future_map.stash(RelayPayload(rows=torch.tensor(rows),
                                               bonus_tokens=torch.tensor([fake_token(p) for p in positions])))
        checker = FinishChecker([EOS], lambda ids: "")
        batch.mark_processed()
        for req, pos in zip(sampled, positions):
            if req.finished:
                continue
            done = apply_new_tokens(req, [fake_token(pos)], None, None, checker)
            self.kv.commit(req)
            if done:
                self.finish(req, req.finished_reason)
        self.rows.on_processed(batch.step_id)

    def _verify(self, batch: ScheduleBatch) -> None:
        """A fake verify: each request keeps its drafts up to a pseudo-random accept count (the
        fake model's tokens either way), then the bonus; the reserved slots must cover the run."""
        checker = FinishChecker([EOS], lambda ids: "")
        batch.mark_processed()
        for span in batch.spans:
            req = span.req
            if req.finished:
                continue
            last = req.seq_len - 1  # where the run starts: every earlier step has been processed
            if req.req_pool_idx is not None:  # (a retracted request's row is gone; its run still counts)
                assert req.kv_alloc_len >= last + 1 + span.drafts, (req.rid, req.kv_alloc_len, last, span.drafts)
            accepted = (last * 7 + len(req.rid)) % (span.drafts + 1)
            tokens = [fake_token(last + 1 + j) for j in range(accepted + 1)]
            self.verify_runs.append((span.drafts, len(tokens)))
            done = apply_new_tokens(req, tokens, None, None, checker)
            self.kv.commit(req)
            if done:
                self.finish(req, req.finished_reason)
        self.rows.on_processed(batch.step_id)

    def finish(self, req: Req, reason: FinishReason | None) -> None:
        req.finished_reason = reason
        self.planner.remove(req)
        self.kv.release(req)
        self.finished.append(req)

    def abort(self, *group_prefixes: str) -> list[Req]:
        """As the scheduler handles an AbortReq: take the requests out, then end each."""
        reqs = self.planner.take(list(group_prefixes), abort_all=False)
        for req in reqs:
            req.finished_reason = FinishReason(type="abort", status_code=200)
            self.kv.release(req)
            self.finished.append(req)
        return reqs

    def run(self, overlap: bool = True, max_steps: int = 10_000) -> list[ScheduleBatch]:
        """Drive the loop until idle: plan N+1, then process N (overlap), or plan-process."""
        batches, in_flight = [], None
        for _ in range(max_steps):
            batch = self.plan()
            if batch is not None:
                batches.append(batch)
            if in_flight is not None:
                self.process(in_flight)
            in_flight = batch
            if not overlap and in_flight is not None:
                self.process(in_flight)
                in_flight = None
            if in_flight is None and not self.planner.has_work():
                return batches
        raise AssertionError("the core did not go idle")

    def assert_no_leaks(self) -> None:
        """Idle: every KV slot is free or in the tree, nothing is locked, every row is free."""
        assert not self.planner.has_work() and not self.rows.step_in_flight
        assert self.kv.leak_report() is None, self.kv.leak_report()


def make_core(max_total_tokens: int = 512, max_running_requests: int = 4, radix: bool = True,
              **cfg) -> Core:
    pool = ReqToTokenPool(2 * max_running_requests + 1, CONTEXT + 8)
    future_map = FutureMap(pool.size, "cpu", debug=True)
    counts = PenaltyCounts(pool.size, VOCAB)
    rows = ReqRows(pool, future_map, counts)
    kv = KVManager(rows, TokenAllocator(max_total_tokens), disable_radix_cache=not radix)
    config = PlannerConfig(context_len=CONTEXT, max_total_tokens=max_total_tokens,
                           max_running_requests=max_running_requests, **cfg)
    planner = Planner(config, kv, BatchContext(VOCAB, (EOS,), torch.device("cpu")))
    return Core(planner, kv, rows, future_map, counts)

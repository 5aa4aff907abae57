"""A SchedulerCore on CPU tensors with a fake model in place of the forward worker.

The fake model "samples" token `1000 + position`, so every output is predictable and retraction
cannot change it; a verify keeps a pseudo-random number of its drafts. `Harness` sequences the
core's calls as the scheduler loop does (plan N+1, apply N) and keeps the requests that ended.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.ipc.messages import FinishReason, LogprobParams, TokenizedGenerateReq
from tandem.runtime.cache.pools import ReqToTokenPool, TokenAllocator
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.sampling.penalties import PenaltyCounts
from tandem.runtime.scheduler.batch import BatchContext, ScheduleBatch
from tandem.runtime.scheduler.core import SchedulerCore
from tandem.runtime.scheduler.forward_worker import GenerationBatchResult
from tandem.runtime.scheduler.future_map import FutureMap, RelayPayload
from tandem.runtime.scheduler.kv_manager import KVManager
from tandem.runtime.scheduler.output_streamer import OutputStreamer
from tandem.runtime.scheduler.planner import Planner, PlannerConfig
from tandem.runtime.scheduler.req_rows import ReqRows
from tandem.runtime.scheduler.request import Phase, Req
from tandem.runtime.scheduler.result_processor import FinishChecker

VOCAB = 4096
EOS = 2
CONTEXT = 256


def fake_token(position: int) -> int:
    return 1000 + position


@dataclass
class FakeWorker:
    """The forward worker's contract: one GenerationBatchResult per step, steps run in launch order."""
    future_map: FutureMap
    verify_runs: list[tuple[int, int]] = field(default_factory=list)  # (drafts allowed, tokens kept)

    def run(self, batch: ScheduleBatch) -> GenerationBatchResult:
        if batch.mode == ForwardMode.TARGET_VERIFY:
            return self._verify(batch)
        job = batch.job
        if job.input_ids is None:  # decode: the input tokens come from the future map (debug: checked)
            self.future_map.gather_bonus(torch.tensor(job.rows))
        tokens = [fake_token(p) for p in job.sample_positions]
        if tokens:
            rows = torch.tensor([job.rows[i] for i in job.sample_indices])
            self.future_map.stash(RelayPayload(rows=rows, bonus_tokens=torch.tensor(tokens)))
        return GenerationBatchResult([[t] for t in tokens], [], [], [], [])

    def _verify(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Each request keeps its drafts up to a pseudo-random count, then the bonus token; the
        slots reserved must cover the whole run (its last token is known only now)."""
        runs = []
        for span in batch.spans:
            req, last = span.req, span.req.seq_len - 1
            if req.kv.req_pool_idx is not None:  # (a retracted request's row is gone; its run still counts)
                assert req.kv.alloc_len >= last + 1 + span.drafts, (req.rid, req.kv.alloc_len, last, span.drafts)
            accepted = (last * 7 + len(req.rid)) % (span.drafts + 1)
            runs.append([fake_token(last + 1 + j) for j in range(accepted + 1)])
            if not req.finished:
                self.verify_runs.append((span.drafts, len(runs[-1])))
        return GenerationBatchResult(runs, [], [], [], [], num_drafts=[s.drafts for s in batch.spans])


class Harness:
    """Drives a SchedulerCore and its FakeWorker; `finished` lists ended requests in order."""

    def __init__(self, core: SchedulerCore, worker: FakeWorker) -> None:
        self.core, self.worker = core, worker
        self.planner, self.kv, self.rows = core.planner, core.kv, core.rows
        self.future_map = worker.future_map
        self.verify_runs = worker.verify_runs
        self.finished: list[Req] = []
        self._reqs: dict[str, Req] = {}

    def add(self, rid: str, prompt: list[int] | int, max_new_tokens: int = 4, priority: int | None = 0,
            logprob: LogprobParams = LogprobParams(), return_hidden_states: bool = False,
            extra_key: str | None = None, expect: Phase = Phase.WAITING, **sp) -> Req:
        # distinct prompts unless a test gives its own (the radix cache shares equal prefixes)
        n = len(self._reqs) + 1
        ids = list(range(10 * n, 10 * n + prompt)) if isinstance(prompt, int) else prompt
        params = SamplingParams(**{"max_new_tokens": max_new_tokens, "ignore_eos": True, **sp})
        msg = TokenizedGenerateReq(rid=rid, input_ids=np.asarray(ids, np.int32), stream=False, sampling_params=params,
                                   priority=priority, logprob=logprob, return_hidden_states=return_hidden_states,
                                   extra_key=extra_key)
        req = self._reqs[rid] = self.core.add(msg)
        self._collect()
        assert req.phase is expect, (req.phase, req.finished_reason)
        return req

    def plan(self) -> ScheduleBatch | None:
        batch = self.core.plan()
        self._collect()
        return batch

    def process(self, batch: ScheduleBatch) -> None:
        self.core.apply(batch, self.worker.run(batch))
        self._collect()

    def abort(self, *group_prefixes: str, abort_all: bool = False) -> list[Req]:
        taken = self.core.abort(list(group_prefixes), abort_all)
        self._collect()
        return taken

    def expire(self, rids: list[str]) -> None:
        self.core.expire(rids, timeout=1.0)
        self._collect()

    def finish(self, req: Req, reason: FinishReason) -> None:
        self.core.finish(req, reason)
        self._collect()

    def step(self, in_flight: ScheduleBatch | None,
             overlap: bool = True) -> tuple[ScheduleBatch | None, ScheduleBatch | None]:
        """One loop iteration: plan N+1, then apply N (overlap), or plan-apply. Returns the step
        planned and the one left in flight."""
        batch = self.plan()
        if in_flight is not None:
            self.process(in_flight)
        in_flight = batch
        if not overlap and in_flight is not None:
            self.process(in_flight)
            in_flight = None
        return batch, in_flight

    def run(self, overlap: bool = True, max_steps: int = 10_000) -> list[ScheduleBatch]:
        """Drive the loop until idle."""
        batches, in_flight = [], None
        for _ in range(max_steps):
            batch, in_flight = self.step(in_flight, overlap)
            if batch is not None:
                batches.append(batch)
            if in_flight is None and not self.planner.has_work():
                return batches
        raise AssertionError("the core did not go idle")

    def _collect(self) -> None:
        out = self.core.flush()
        if out is not None:
            self.finished += [self._reqs[rid] for rid, why in zip(out.rids, out.finished_reasons) if why is not None]

    def assert_no_leaks(self) -> None:
        """Idle: every KV slot is free or in the tree, nothing is locked, every row is free."""
        assert not self.planner.has_work() and not self.rows.step_in_flight
        assert self.kv.leak_report() is None, self.kv.leak_report()


def make_core(max_total_tokens: int = 512, max_running_requests: int = 4, radix: bool = True,
              **cfg) -> Harness:
    pool = ReqToTokenPool(2 * max_running_requests + 1, CONTEXT + 8)
    future_map = FutureMap(pool.size, "cpu", debug=True)
    rows = ReqRows(pool, future_map, PenaltyCounts(pool.size, VOCAB))
    kv = KVManager(rows, TokenAllocator(max_total_tokens), disable_radix_cache=not radix)
    config = PlannerConfig(context_len=CONTEXT, max_total_tokens=max_total_tokens,
                           max_running_requests=max_running_requests, **cfg)
    planner = Planner(config, kv, BatchContext(VOCAB, (EOS,), torch.device("cpu")))
    core = SchedulerCore(planner, FinishChecker([EOS], lambda ids: ""), OutputStreamer(1))
    return Harness(core, FakeWorker(future_map))

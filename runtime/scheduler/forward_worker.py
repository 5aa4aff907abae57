"""The forward worker: runs planned steps in order on its own thread and relays tokens through the FutureMap.

The scheduler thread plans step N+1 and hands it here while step N may still run; torch
releases the GIL inside ops, so planning, result processing and the forward truly overlap
(on CUDA the thread also keeps kernel launches off the scheduler's critical path). Jobs run
strictly in submission order, which is what makes deferred frees and in-flight cache
insertion safe: a slot freed after step N is only reused by a step that runs after it.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.sampling.logprob_format import LogprobArrays
from tandem.runtime.sampling.logprobs import LogprobChunk, batch_output_logprobs, compute_logprobs_from_hidden
from tandem.runtime.sampling.penalties import apply_penalties
from tandem.runtime.sampling.sampler import SamplingBatchInfo, sample
from tandem.runtime.scheduler.future_map import FutureMap, RelayPayload


@dataclass
class InputLogprobTask:
    req_index: int
    first_row: int  # prompt row (= position) of the first hidden row to score
    token_offset: int  # index of that row in the batch's token dim
    next_ids: list[int]  # the prompt token each row predicts
    top_k: int
    token_ids: list[int] | None


@dataclass
class PenaltyInfo:
    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    logit_bias: torch.Tensor | None
    min_tokens_mask: torch.Tensor | None
    banned_ids: list[list[int]]  # per row: stop_token_ids, plus EOS unless ignore_eos
    counts_active: bool
    reset_rows: list[tuple[int, list[int]]]  # (row, output ids so far) for rows starting a count


@dataclass
class ForwardJob:
    mode: ForwardMode
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int] | None  # None for decode: gathered from the future map at launch
    out_cache_loc: torch.Tensor
    sample_indices: list[int]  # requests (batch indices) that sample a token in this pass
    sampling: SamplingBatchInfo | None  # for the sampling requests, in order
    sample_positions: list[int]  # position each sampled token takes (seeds the noise)
    logprob_tops: list[int] | None = None  # per sampling request: top-k, or -1 when no logprobs
    logprob_token_ids: list[list[int] | None] | None = None
    input_logprob_tasks: list[InputLogprobTask] = field(default_factory=list)
    penalties: PenaltyInfo | None = None
    poison_rows: list[int] = field(default_factory=list)
    follows_busy_step: bool = False  # the scheduler had work since the previous job: a gap before it is idling


@dataclass
class GenerationBatchResult:
    next_token_ids: list[int]  # one per sampling request, in job.sample_indices order
    output_logprobs: list[LogprobArrays | None]
    input_logprob_chunks: list[tuple[int, int, LogprobChunk]]  # (req_index, first_row, chunk)
    forward_s: float

    @property
    def has_sampled_token_ids(self) -> bool:
        return bool(self.next_token_ids)


class ForwardWorker:
    def __init__(self, runner: ModelRunner, future_map: FutureMap) -> None:
        self.runner = runner
        self.future_map = future_map
        self._counts: torch.Tensor | None = None  # [rows, V] output token counts, made on first use
        self._jobs: queue.Queue[tuple[ForwardJob, Future] | None] = queue.Queue()
        self._busy_s = 0.0
        self._idle_s = 0.0
        self._last_end: float | None = None
        self._thread = threading.Thread(target=self._loop, name="tandem-forward", daemon=True)
        self._thread.start()

    def submit(self, job: ForwardJob) -> Future:
        fut: Future = Future()
        self._jobs.put((job, fut))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def idle_fraction(self) -> float:
        """Share of time the device waited for the next step while the scheduler had work
        (gaps after the server was idle do not count)."""
        total = self._busy_s + self._idle_s
        return self._idle_s / total if total > 0 else 0.0

    def busy_idle_seconds(self) -> tuple[float, float]:
        return self._busy_s, self._idle_s

    def _loop(self) -> None:
        # On CUDA the worker deliberately stays on the default stream: the scheduler thread writes
        # req_to_token rows and slot indices there before submitting a job, and one stream orders
        # those writes before the job's kernels without any event bookkeeping.
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut = item
            t0 = time.perf_counter()
            if job.follows_busy_step and self._last_end is not None:
                self._idle_s += t0 - self._last_end
            try:
                fut.set_result(self.run(job))
            except BaseException as exc:  # surfaces in the scheduler thread via fut.result()
                fut.set_exception(exc)
            self._last_end = time.perf_counter()
            self._busy_s += self._last_end - t0

    @torch.inference_mode()
    def run(self, job: ForwardJob) -> GenerationBatchResult:
        t0 = time.perf_counter()
        r, device = self.runner, self.runner.device
        self.future_map.poison(job.poison_rows)
        rows = torch.tensor(job.rows, dtype=torch.int64, device=device)
        if job.input_ids is None:
            input_ids = self.future_map.gather_bonus(rows)
        else:
            input_ids = torch.tensor(job.input_ids, dtype=torch.int64, device=device)
        ends = torch.tensor(job.extend_lens, dtype=torch.int64).cumsum(0) - 1
        batch = ForwardBatch.build(job.mode, input_ids, job.rows, job.prefix_lens, job.extend_lens,
                                   job.out_cache_loc, ends[job.sample_indices].tolist(), device)
        hidden = r.model.hidden_states(batch, r.attn_backend)
        input_chunks = [self._input_logprobs(hidden, task) for task in job.input_logprob_tasks]
        if not job.sample_indices:
            return GenerationBatchResult([], [], input_chunks, time.perf_counter() - t0)
        logits = r.model.logits(hidden[batch.logits_indices]).float()
        sample_rows = rows[job.sample_indices]
        next_ids = self._sample(logits, job, sample_rows)
        self.future_map.stash(RelayPayload(rows=sample_rows, bonus_tokens=next_ids))
        out_lp = self._output_logprobs(logits, next_ids, job)
        return GenerationBatchResult(next_ids.tolist(), out_lp, input_chunks, time.perf_counter() - t0)

    def _sample(self, logits: torch.Tensor, job: ForwardJob, sample_rows: torch.Tensor) -> torch.Tensor:
        pen = job.penalties
        if pen is not None:
            counts = None
            if pen.counts_active:
                counts = self._penalty_counts(pen.reset_rows)[sample_rows]
            logits = apply_penalties(logits, counts, pen.frequency, pen.presence, pen.repetition,
                                     logit_bias=pen.logit_bias, min_tokens_mask=pen.min_tokens_mask,
                                     banned_ids=pen.banned_ids)
        positions = torch.tensor(job.sample_positions, dtype=torch.int64, device=logits.device)
        next_ids = sample(logits, job.sampling, positions)  # type: ignore[arg-type]
        if self._counts is not None:
            self._counts[sample_rows, next_ids] += 1
        return next_ids

    def _penalty_counts(self, reset_rows: list[tuple[int, list[int]]]) -> torch.Tensor:
        if self._counts is None:
            r = self.runner
            self._counts = torch.zeros((r.req_to_token_pool.size, r.config.vocab_size), dtype=torch.int32,
                                       device=r.device)
        for row, outputs in reset_rows:
            self._counts[row].zero_()
            if outputs:
                ids = torch.tensor(outputs, dtype=torch.int64, device=self._counts.device)
                self._counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return self._counts

    def _output_logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor, job: ForwardJob) -> list[LogprobArrays | None]:
        tops = job.logprob_tops
        if not tops or all(k < 0 for k in tops):
            return []
        picks = [i for i, k in enumerate(tops) if k >= 0]
        arrays = batch_output_logprobs(logits[picks], next_ids[picks], [tops[i] for i in picks],
                                       [job.logprob_token_ids[i] for i in picks])  # type: ignore[index]
        out: list[LogprobArrays | None] = [None] * len(tops)
        for i, a in zip(picks, arrays):
            out[i] = a
        return out

    def _input_logprobs(self, hidden: torch.Tensor, task: InputLogprobTask) -> tuple[int, int, LogprobChunk]:
        n = len(task.next_ids)
        rows = hidden[task.token_offset:task.token_offset + n]
        next_ids = torch.tensor(task.next_ids, dtype=torch.int64, device=hidden.device)
        chunk = compute_logprobs_from_hidden(rows, lambda h: self.runner.model.logits(h).float(), next_ids,
                                             task.top_k, task.token_ids)
        return task.req_index, task.first_row, chunk

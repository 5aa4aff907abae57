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

import numpy as np
import torch

from tandem.ipc.messages import LogprobArrays
from tandem.runtime.envs import envs
from tandem.runtime.grammar.mask import GrammarMask
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.sampling.logprobs import LogprobChunk, batch_output_logprobs, compute_logprobs_from_hidden
from tandem.runtime.sampling.penalties import PenaltyCounts, apply_penalties
from tandem.runtime.sampling.sampler import SamplingBatchInfo, sample
from tandem.runtime.scheduler.future_map import FutureMap, RelayPayload
from tandem.runtime.scheduler.stats import StepStats


@dataclass
class PromptRowsTask:
    """Prompt rows of one request computed in this extend pass: positions [first_pos, first_pos + n)."""

    req_index: int  # into the batch's requests
    first_pos: int
    token_offset: int  # index of first_pos's row in the batch's token dim
    n: int


@dataclass
class InputLogprobTask(PromptRowsTask):
    next_ids: list[int] = field(default_factory=list)  # the prompt token each row predicts
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None


@dataclass
class PenaltyInfo:
    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    logit_bias: torch.Tensor | None
    min_tokens_mask: torch.Tensor | None
    banned_ids: list[list[int]]  # per row: stop_token_ids, plus EOS unless ignore_eos
    counts_active: bool


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
    top_logprobs_nums: list[int] | None = None  # per sampling request: top-N, or -1 when no logprobs
    token_ids_logprob: list[tuple[int, ...] | None] | None = None
    return_hidden: list[bool] | None = None  # per sampling request
    input_logprob_tasks: list[InputLogprobTask] = field(default_factory=list)
    prompt_hidden_tasks: list[PromptRowsTask] = field(default_factory=list)
    penalties: PenaltyInfo | None = None
    grammar_mask: GrammarMask | None = None  # filled by the scheduler while this step's forward runs
    follows_busy_step: bool = False  # the scheduler had work since the previous job: a gap before it is idling


@dataclass
class GenerationBatchResult:
    # per sampling request, in job.sample_indices order: the tokens it got (one without speculation)
    next_token_ids: list[list[int]]
    output_logprobs: list[LogprobArrays | None]
    output_hidden: list[np.ndarray | None]  # [1, H] float32 rows
    input_logprob_chunks: list[tuple[InputLogprobTask, LogprobChunk]]
    prompt_hidden_chunks: list[tuple[PromptRowsTask, np.ndarray]]

    @property
    def has_sampled_token_ids(self) -> bool:
        return bool(self.next_token_ids)


class ForwardWorker:
    def __init__(self, runner: ModelRunner, future_map: FutureMap, penalty_counts: PenaltyCounts,
                 stats: StepStats) -> None:
        self.runner = runner
        self.future_map = future_map
        self.penalty_counts = penalty_counts
        self.stats = stats
        self._test_hang_s = envs.TEST_FORWARD_HANG.get()
        self._jobs: queue.Queue[tuple[ForwardJob, Future]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="tandem-forward", daemon=True)
        self._thread.start()

    def submit(self, job: ForwardJob) -> Future:
        fut: Future = Future()
        self._jobs.put((job, fut))
        return fut

    def _loop(self) -> None:
        # On CUDA the worker deliberately stays on the default stream: the scheduler thread writes
        # req_to_token rows and slot indices there before submitting a job, and one stream orders
        # those writes before the job's kernels without any event bookkeeping.
        while True:
            job, fut = self._jobs.get()
            if self._test_hang_s:
                time.sleep(self._test_hang_s)
            t0 = time.perf_counter()
            try:
                fut.set_result(self.run(job))
            except BaseException as exc:  # surfaces in the scheduler thread via fut.result()
                fut.set_exception(exc)
            self.stats.record_device(t0, time.perf_counter(), job.follows_busy_step)

    @torch.inference_mode()
    def run(self, job: ForwardJob) -> GenerationBatchResult:
        r, device = self.runner, self.runner.device
        rows = torch.tensor(job.rows, dtype=torch.int64, device=device)
        if job.input_ids is None:
            input_ids = self.future_map.gather_bonus(rows)
        else:
            input_ids = torch.tensor(job.input_ids, dtype=torch.int64, device=device)
        ends = torch.tensor(job.extend_lens, dtype=torch.int64).cumsum(0) - 1
        batch = ForwardBatch.build(job.mode, input_ids, job.rows, job.prefix_lens, job.extend_lens,
                                   job.out_cache_loc, ends[job.sample_indices].tolist(), device)
        hidden = r.model.hidden_states(batch, r.attn_backend)
        input_chunks = [(task, self._input_logprobs(hidden, task)) for task in job.input_logprob_tasks]
        prompt_hidden = [(task, _host_rows(hidden[task.token_offset:task.token_offset + task.n]))
                         for task in job.prompt_hidden_tasks]
        if not job.sample_indices:
            return GenerationBatchResult([], [], [], input_chunks, prompt_hidden)
        sampled_hidden = hidden[batch.logits_indices]
        logits = r.model.logits(sampled_hidden).float()
        sample_rows = rows[job.sample_indices]
        next_ids = self._sample(logits, job, sample_rows)
        self.future_map.stash(RelayPayload(rows=sample_rows, bonus_tokens=next_ids))
        out_lp = self._output_logprobs(logits, next_ids, job)
        out_hidden = self._output_hidden(sampled_hidden, job)
        return GenerationBatchResult([[t] for t in next_ids.tolist()], out_lp, out_hidden, input_chunks, prompt_hidden)

    def _sample(self, logits: torch.Tensor, job: ForwardJob, sample_rows: torch.Tensor) -> torch.Tensor:
        if job.grammar_mask is not None:  # before penalties: a bias cannot revive a masked token
            logits = job.grammar_mask.apply(logits)
        pen = job.penalties
        if pen is not None:
            counts = self.penalty_counts.gather(sample_rows) if pen.counts_active else None
            logits = apply_penalties(logits, counts, pen.frequency, pen.presence, pen.repetition,
                                     logit_bias=pen.logit_bias, min_tokens_mask=pen.min_tokens_mask,
                                     banned_ids=pen.banned_ids)
        positions = torch.tensor(job.sample_positions, dtype=torch.int64, device=logits.device)
        next_ids = sample(logits, job.sampling, positions)  # type: ignore[arg-type]
        self.penalty_counts.add(sample_rows, next_ids)
        return next_ids

    def _output_logprobs(self, logits: torch.Tensor, next_ids: torch.Tensor, job: ForwardJob) -> list[LogprobArrays | None]:
        nums = job.top_logprobs_nums
        if not nums or all(k < 0 for k in nums):
            return []
        picks = [i for i, k in enumerate(nums) if k >= 0]
        arrays = batch_output_logprobs(logits[picks], next_ids[picks], [nums[i] for i in picks],
                                       [job.token_ids_logprob[i] for i in picks])  # type: ignore[index]
        out: list[LogprobArrays | None] = [None] * len(nums)
        for i, a in zip(picks, arrays):
            out[i] = a
        return out

    @staticmethod
    def _output_hidden(sampled_hidden: torch.Tensor, job: ForwardJob) -> list[np.ndarray | None]:
        wants = job.return_hidden
        if not wants or not any(wants):
            return []
        rows = _host_rows(sampled_hidden)
        return [rows[i:i + 1] if w else None for i, w in enumerate(wants)]

    def _input_logprobs(self, hidden: torch.Tensor, task: InputLogprobTask) -> LogprobChunk:
        rows = hidden[task.token_offset:task.token_offset + task.n]
        next_ids = torch.tensor(task.next_ids, dtype=torch.int64, device=hidden.device)
        return compute_logprobs_from_hidden(rows, lambda h: self.runner.model.logits(h).float(), next_ids,
                                            task.top_logprobs_num, task.token_ids_logprob)


def _host_rows(rows: torch.Tensor) -> np.ndarray:
    """Hidden rows as a float32 host array that owns its memory (the model's buffers get reused)."""
    return rows.detach().to("cpu", torch.float32).numpy().copy()

"""The forward worker: runs planned steps in order on its own thread and relays tokens through the FutureMap.

The scheduler thread plans step N+1 and hands it here while step N may still run; torch
releases the GIL inside ops, so planning, result processing and the forward truly overlap
(on CUDA the thread also keeps kernel launches off the scheduler's critical path). Jobs run
strictly in submission order, which is what makes deferred frees and in-flight cache
insertion safe: a slot freed after step N is only reused by a step that runs after it.

Output logprobs are read off the very logits a token was sampled from (`SampledRows`: after the
grammar mask, penalties, logit bias and bans), scaled by the row's temperature as SGLang's, in
plain decoding and in a verify alike; a step where no request asks for them computes nothing.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

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
from tandem.runtime.scheduler.cpu_share import CpuShare
from tandem.runtime.scheduler.future_map import FutureMap, RelayPayload
from tandem.runtime.scheduler.stats import StepStats
from tandem.runtime.speculative.drafter import Drafter
from tandem.runtime.speculative.verify import VerifyLayout, accept_runs

logger = logging.getLogger("tandem.scheduler")


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
    ban_mask: torch.Tensor | None  # [B, V] bool: rows under min_new_tokens, their stop_token_ids and EOS
    counts_active: bool

    def spread(self, per_row: torch.Tensor) -> "PenaltyInfo":
        """The same penalties for logits rows that belong to requests `per_row` (a verify's tokens)."""
        return PenaltyInfo(
            frequency=self.frequency[per_row], presence=self.presence[per_row], repetition=self.repetition[per_row],
            logit_bias=None if self.logit_bias is None else self.logit_bias[per_row],
            ban_mask=None if self.ban_mask is None else self.ban_mask[per_row], counts_active=self.counts_active)


@dataclass
class SpecInfo:
    """Speculative servers: per sampling request of a step, what the worker verifies and drafts."""

    max_drafts: list[int]  # verify: most drafts to check after the last token (0: a plain decode)
    make_drafts: list[bool]  # propose drafts for the request's next step
    pos_limits: list[int]  # prompt + max_new_tokens: no position at or past it is ever computed
    histories: list[list[int]] | None  # prefill: every token so far (the drafter's row starts over)


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
    spec: SpecInfo | None = None
    forced_ids: list[int] | None = None  # per sampling request: a token to emit instead of sampling (-1: none)
    follows_busy_step: bool = False  # the scheduler had work since the previous job: a gap before it is idling


@dataclass
class SampledRows:
    """What one pass sampled: the ids, and the distribution they were drawn from (for logprobs)."""

    ids: torch.Tensor  # [N] int64, forced tokens included
    logits: torch.Tensor  # [N, V]: after the grammar mask, penalties, logit bias and bans; before temperature
    info: SamplingBatchInfo  # the settings of each of the N rows


@dataclass
class GenerationBatchResult:
    # per sampling request, in job.sample_indices order: the tokens it got (one without speculation)
    next_token_ids: list[list[int]]
    output_logprobs: list[list[LogprobArrays] | None]  # one block per token (empty list: none asked)
    output_hidden: list[list[np.ndarray] | None]  # one [1, H] float32 row per token
    input_logprob_chunks: list[tuple[InputLogprobTask, LogprobChunk]]
    prompt_hidden_chunks: list[tuple[PromptRowsTask, np.ndarray]]
    num_drafts: list[int] = field(default_factory=list)  # verify: drafts checked per request

    @property
    def has_sampled_token_ids(self) -> bool:
        return bool(self.next_token_ids)


def reserve_intra_op_threads() -> int:
    """Leave the calling thread one intra-op thread and return the count the forward thread takes.

    Call it before the model loads. Invariant: one OpenMP team in the process at full size (the
    forward thread's). libgomp keeps a team for every thread that ever ran a parallel region, and
    with more OpenMP threads than CPUs it cuts their spin-wait, so every small op of a step would
    pay futex wake-ups. The count is per thread in OpenMP; the worker sets its own when it starts.
    """
    threads = torch.get_num_threads()  # also fixes this thread's count, so later calls elsewhere leave it
    torch.set_num_threads(1)
    return threads


class ForwardWorker:
    def __init__(self, runner: ModelRunner, future_map: FutureMap, penalty_counts: PenaltyCounts,
                 stats: StepStats, drafter: Drafter | None, intra_op_threads: int) -> None:
        self.runner = runner
        self._intra_op_threads = intra_op_threads
        self.drafter = drafter
        self.future_map = future_map
        self.penalty_counts = penalty_counts
        self.stats = stats
        self._test_hang_s = envs.TEST_FORWARD_HANG.get()
        self._original_logprob = envs.RETURN_ORIGINAL_LOGPROB.get()
        self._jobs: queue.Queue[tuple[ForwardJob | Callable[[], Any], Future]] = queue.Queue()
        self._ready: Future = Future()
        self._thread = threading.Thread(target=self._loop, name="tandem-forward", daemon=True)
        self._thread.start()
        self._ready.result()  # a failure to pack the weights surfaces here, in the scheduler's start-up

    def submit(self, job: ForwardJob) -> Future:
        fut: Future = Future()
        self._jobs.put((job, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the forward thread after the jobs before it (a weight update: it must not
        overlap a step, and packing belongs to this thread's thread count)."""
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def _loop(self) -> None:
        # On CUDA the worker deliberately stays on the default stream: the scheduler thread writes
        # req_to_token rows and slot indices there before submitting a job, and one stream orders
        # those writes before the job's kernels without any event bookkeeping.
        torch.set_num_threads(self._intra_op_threads)
        try:
            self.runner.pack_weights()  # here, under this thread's count: see ModelRunner.pack_weights
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        share = CpuShare(self._intra_op_threads) if self.runner.device.type == "cpu" and envs.CPU_SHARE.get() else None
        threads = self._intra_op_threads
        while True:
            job, fut = self._jobs.get()
            if share is not None and (wanted := share.threads()) != threads:
                logger.info("intra-op threads %d -> %d: other processes keep %d of %d cores busy", threads, wanted,
                            self._intra_op_threads - wanted, self._intra_op_threads)
                torch.set_num_threads(threads := wanted)
                self.stats.intra_op_threads = threads
            if self._test_hang_s:
                time.sleep(self._test_hang_s)
            if callable(job):
                try:
                    fut.set_result(job())
                except BaseException as exc:
                    fut.set_exception(exc)
                continue
            t0 = time.perf_counter()
            try:
                fut.set_result(self.run(job))
            except BaseException as exc:  # surfaces in the scheduler thread via fut.result()
                fut.set_exception(exc)
            self.stats.record_device(t0, time.perf_counter(), job.follows_busy_step)

    @torch.inference_mode()
    def run(self, job: ForwardJob) -> GenerationBatchResult:
        if job.mode == ForwardMode.TARGET_VERIFY:
            return self._run_verify(job)
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
        logits = r.model.logits(sampled_hidden)  # the model's dtype: widened only where needed
        sample_rows = rows[job.sample_indices]
        positions = torch.tensor(job.sample_positions, dtype=torch.int64, device=device)
        sampled = self._sample(logits, job, positions, sample_rows)
        next_ids = sampled.ids
        self.penalty_counts.add(sample_rows, next_ids)
        runs = [[t] for t in next_ids.tolist()]
        self._relay(sample_rows, next_ids, job, runs, [p - 1 for p in job.sample_positions])
        one_each = list(range(len(runs)))
        out_lp = self._output_logprobs(sampled, one_each, job, one_each, [1] * len(runs))
        out_hidden = self._output_hidden(sampled_hidden, job, [1] * len(runs))
        return GenerationBatchResult(runs, out_lp, out_hidden, input_chunks, prompt_hidden)

    def _run_verify(self, job: ForwardJob) -> GenerationBatchResult:
        """One target pass over each request's last token and drafts; keep what the target agrees
        with (speculative/verify.py). Positions come from the future map: on a GPU the worker
        thread waits for the previous step here, never the scheduler."""
        r, device, spec = self.runner, self.runner.device, job.spec
        assert spec is not None and self.drafter is not None
        rows = torch.tensor(job.rows, dtype=torch.int64, device=device)
        bonus = self.future_map.gather_bonus(rows)
        drafts, draft_lens, seq_lens = self.future_map.gather_draft(rows, self.drafter.num_drafts)
        num_drafts = [min(n, m) for n, m in zip(draft_lens.tolist(), spec.max_drafts)]
        layout = VerifyLayout.build(seq_lens.tolist(), num_drafts)
        row_of = torch.tensor(layout.row_of, dtype=torch.int64, device=device)
        cols = torch.tensor(layout.cols, dtype=torch.int64, device=device)
        runs_in = torch.cat([bonus[:, None], drafts], dim=1)
        input_ids = runs_in[row_of, cols]
        positions = torch.tensor(layout.positions(), dtype=torch.int64, device=device)
        out_cache_loc = r.req_to_token_pool.req_to_token[rows[row_of], positions]
        mode = ForwardMode.DECODE if not any(num_drafts) else ForwardMode.EXTEND
        batch = ForwardBatch.build(mode, input_ids, job.rows, layout.seq_lens, [n + 1 for n in num_drafts],
                                   out_cache_loc, list(range(layout.num_tokens)), device)
        hidden = r.model.hidden_states(batch, r.attn_backend)
        logits = r.model.logits(hidden)
        verified = self._sample(logits, job, positions + 1, rows[row_of], (layout, row_of))
        sampled = verified.ids
        runs = accept_runs(sampled.tolist(), drafts.tolist(), layout)
        kept_rows = layout.kept_indices(runs)
        kept = torch.tensor(kept_rows, dtype=torch.int64, device=device)
        self.penalty_counts.add(rows[row_of[kept]], sampled[kept])
        last = torch.tensor([layout.offsets[i] + len(run) - 1 for i, run in enumerate(runs)], device=device)
        self._relay(rows, sampled[last], job, runs, layout.seq_lens)
        counts = [len(run) for run in runs]
        out_lp = self._output_logprobs(verified, kept_rows, job, [i for i, run in enumerate(runs) for _ in run], counts)
        return GenerationBatchResult(runs, out_lp, self._output_hidden(hidden[kept], job, counts), [], [], num_drafts)

    def _relay(self, rows: torch.Tensor, bonus: torch.Tensor, job: ForwardJob, runs: list[list[int]],
               starts: list[int]) -> None:
        """Stash each request's last token for the next step (and, speculating, where it sits and
        the drafts to check after it). `starts[i]`: the position of the run's first input token."""
        spec = job.spec
        if spec is None or self.drafter is None:
            self.future_map.stash(RelayPayload(rows=rows, bonus_tokens=bonus))
            return
        row_ids = rows.tolist()
        seq_lens = [start + len(run) for start, run in zip(starts, runs)]  # the new last token's position
        for i, (row, start, run) in enumerate(zip(row_ids, starts, runs)):
            if spec.histories is not None:
                self.drafter.start(row, spec.histories[i])
            self.drafter.append(row, start + 1, run)
        drafts, lens = self.drafter.propose(row_ids, seq_lens, spec.make_drafts, spec.pos_limits)
        device = rows.device
        self.future_map.stash(RelayPayload(
            rows=rows, bonus_tokens=bonus, seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            draft_tokens=torch.from_numpy(drafts).to(device), draft_lens=torch.from_numpy(lens).to(device)))

    def _sample(self, logits: torch.Tensor, job: ForwardJob, positions: torch.Tensor, pool_rows: torch.Tensor,
                verify: tuple[VerifyLayout, torch.Tensor] | None = None) -> SampledRows:
        """Sample every row of `logits` (`pool_rows`: each one's request row). A verify's logits rows
        are the tokens of the requests' runs (`verify`: the layout and its row_of on the device),
        and the per-request settings are spread over them. The logits it returns are those the
        sampler saw (no copy is made when nothing changes them)."""
        layout, per_row = verify if verify is not None else (None, None)
        if job.grammar_mask is not None or job.penalties is not None:
            logits = logits.float()
        if job.grammar_mask is not None:  # before penalties: a bias cannot revive a masked token
            # constrained requests never draft, so their run is one token: the first of the run
            logit_rows = None if layout is None else [layout.offsets[i] for i in job.grammar_mask.sample_indices]
            logits = job.grammar_mask.apply(logits, logit_rows)
        pen = job.penalties
        if pen is not None:
            pen = pen if per_row is None else pen.spread(per_row)
            counts = self.penalty_counts.gather(pool_rows) if pen.counts_active else None
            logits = apply_penalties(logits, counts, pen.frequency, pen.presence, pen.repetition,
                                     logit_bias=pen.logit_bias, ban_mask=pen.ban_mask,
                                     grammar_masked=job.grammar_mask is not None)
        info = job.sampling if per_row is None else job.sampling.take(per_row)  # type: ignore[union-attr]
        sampled = sample(logits, info, positions)  # type: ignore[arg-type]
        if job.forced_ids is not None:  # requests with a forced token never draft: their run is one token
            rows = [i if layout is None else layout.offsets[i] for i, t in enumerate(job.forced_ids) if t >= 0]
            sampled[rows] = torch.tensor([t for t in job.forced_ids if t >= 0], dtype=sampled.dtype,
                                         device=sampled.device)
        return SampledRows(sampled, logits, info)  # type: ignore[arg-type]

    def _output_logprobs(self, sampled: SampledRows, kept_rows: list[int], job: ForwardJob, owner: list[int],
                         counts: list[int]) -> list[list[LogprobArrays] | None]:
        """Logprobs of each kept token under the distribution it was sampled from (SGLang's:
        log_softmax(processed logits / temperature); TANDEM_RETURN_ORIGINAL_LOGPROB leaves out the
        temperature). `kept_rows[t]` is kept token t's row in `sampled`, `owner[t]` its request
        (tokens grouped by request, in order) and `counts[i]` how many request i kept."""
        nums = job.top_logprobs_nums
        if not nums or all(k < 0 for k in nums):  # first: a step without logprobs pays nothing
            return []
        picks = [t for t, i in enumerate(owner) if nums[i] >= 0]
        rows = torch.tensor([kept_rows[t] for t in picks], dtype=torch.int64, device=sampled.ids.device)
        temperatures = None if self._original_logprob else sampled.info.temperatures[rows]
        arrays = iter(batch_output_logprobs(sampled.logits[rows], sampled.ids[rows], [nums[owner[t]] for t in picks],
                                            [job.token_ids_logprob[owner[t]] for t in picks],  # type: ignore[index]
                                            temperatures=temperatures))
        return [[next(arrays) for _ in range(n)] if k >= 0 else None for k, n in zip(nums, counts)]

    @staticmethod
    def _output_hidden(kept_hidden: torch.Tensor, job: ForwardJob, counts: list[int]) -> list[list[np.ndarray] | None]:
        """One [1, H] row per kept token (grouped by request, `counts[i]` each)."""
        wants = job.return_hidden
        if not wants or not any(wants):
            return []
        rows = _host_rows(kept_hidden)
        starts = np.cumsum([0, *counts])
        return [[rows[t:t + 1] for t in range(starts[i], starts[i + 1])] if w else None for i, w in enumerate(wants)]

    def _input_logprobs(self, hidden: torch.Tensor, task: InputLogprobTask) -> LogprobChunk:
        rows = hidden[task.token_offset:task.token_offset + task.n]
        next_ids = torch.tensor(task.next_ids, dtype=torch.int64, device=hidden.device)
        return compute_logprobs_from_hidden(rows, lambda h: self.runner.model.logits(h).float(), next_ids,
                                            task.top_logprobs_num, task.token_ids_logprob)


def _host_rows(rows: torch.Tensor) -> np.ndarray:
    """Hidden rows as a float32 host array that owns its memory (the model's buffers get reused)."""
    return rows.detach().to("cpu", torch.float32).numpy().copy()

"""SchedulerCore: every scheduler-side transition of a request, with no process, socket or model.

A request's life, top to bottom:

    add ──> COMPILING (grammar queue) ──settle──> WAITING ──plan──> CHUNKED ──plan──> RUNNING
     │             │                                 ▲                 │                 │
     │             └── compile error / timeout ──┐   └──── retract ────┴─────────────────┤
     └── refused at admission ───────────────────┴──> DONE <── abort / expire / apply ───┘

`Req.phase` is written here and nowhere else; `_release` is the one place a request ends (its
KV goes back, its last output is queued for the detokenizer). The planner only chooses the next
batch; what it retracts or gives up on comes back in its `Plan` and is applied here. The process
shell (scheduler.py) receives messages, calls these methods, launches what `plan` returns on the
forward worker and hands its result to `apply`.
"""
from __future__ import annotations

import random

from tandem.ipc.messages import BatchTokenIDOutput, FinishReason, TokenizedGenerateReq
from tandem.runtime.scheduler.batch import ScheduleBatch
from tandem.runtime.scheduler.forward_worker import GenerationBatchResult
from tandem.runtime.scheduler.grammar_queue import GrammarQueue, grammar_size_error
from tandem.runtime.scheduler.output_streamer import OutputStreamer
from tandem.runtime.scheduler.planner import Planner
from tandem.runtime.scheduler.request import Phase, Req, abort_prefixes
from tandem.runtime.scheduler.result_processor import FinishChecker, apply_new_tokens
from tandem.runtime.scheduler.stats import StepStats
from tandem.runtime.scheduler.think import ReasoningState

# SGLang's words and statuses
_DISPLACED = FinishReason(type="abort", status_code=503, err_type="ServiceUnavailable",
                          message="The request is aborted by a higher priority request.")
_QUEUE_FULL = FinishReason(type="abort", status_code=503, err_type="ServiceUnavailable",
                           message="The request queue is full.")
_PRIORITY_DISABLED = FinishReason(type="abort", status_code=503, err_type="ServiceUnavailable",
                                  message="Using priority is disabled for this server. "
                                          "Please send a new request without a priority.")


class SchedulerCore:
    def __init__(self, planner: Planner, checker: FinishChecker, streamer: OutputStreamer,
                 grammar_queue: GrammarQueue | None = None, max_grammar_bytes: int = 1 << 62,
                 random_seed: int = 0, stats: StepStats | None = None,
                 think_end_ids: tuple[int, ...] = ()) -> None:
        self.planner = planner
        self.kv = planner.kv
        self.rows = planner.kv.rows
        self.checker = checker
        self.streamer = streamer
        self.grammar_queue = grammar_queue
        self.max_grammar_bytes = max_grammar_bytes
        self.stats = stats or StepStats()
        self.think_end_ids = think_end_ids  # "</think>" tokenized
        self._arrivals = 0
        self.paused = False  # pause_generation: no step is planned until continue_generation
        self.memory_released = False  # release_memory_occupation: no step until it is resumed
        self._seed_rng = random.Random(random_seed)  # seeds of seedless requests: alike on every TP rank

    # -- arrival -----------------------------------------------------------------------------------------
    def add(self, msg: TokenizedGenerateReq) -> Req:
        """A new request: refused (DONE with a 400/503), COMPILING its grammar, or WAITING."""
        self._arrivals += 1
        req = Req.from_message(msg, self._arrivals, self._seed_rng.getrandbits(63))
        if req.require_reasoning or req.sampling_params.max_thinking_tokens is not None:
            req.think = ReasoningState(self.think_end_ids)
        constraint = req.sampling_params.constraint
        error = self.admission_error(req)
        if error is None and constraint is not None and self.grammar_queue is None:
            error = FinishReason.bad_request(f"sampling_params.{constraint[0]}",
                                             "needs guided decoding, which is off on this server "
                                             "(--grammar-backend none)")
        if error is None and constraint is not None:
            error = grammar_size_error(constraint, self.max_grammar_bytes)
        if error is not None:
            self._release(req, error)
        elif constraint is not None:
            req.phase = Phase.COMPILING
            self.grammar_queue.add(req)  # type: ignore[union-attr]
        else:
            self._enqueue(req)
        return req

    def settle(self, ready: list[Req], failed: list[tuple[Req, FinishReason]]) -> None:
        """Grammars that finished compiling: their requests queue up; failed compiles end theirs."""
        for req in ready:
            self._enqueue(req)
        for req, reason in failed:
            self._release(req, reason)

    def _enqueue(self, req: Req) -> None:
        """Into the waiting queue, within --max-queued-requests (a more urgent arrival may displace
        the least urgent waiting request, as SGLang's _abort_on_queued_limit)."""
        if (error := self.queue_error(req)) is not None:
            self._release(req, error)
            return
        if (victim := self.queue_victim(req)) is not None:
            self.finish(victim, _DISPLACED)
        req.phase = Phase.WAITING
        self.planner.add(req)

    def admission_error(self, req: Req) -> FinishReason | None:
        """Checks that need the scheduler's numbers and flags; the tokenizer manager did the rest."""
        cfg = self.planner.cfg
        for limit, what in ((cfg.context_len, "exceeds the context length"),
                            (cfg.max_total_tokens, "needs more KV slots than the server has")):
            if req.max_total_len() > limit:
                return FinishReason.bad_request(
                    "sampling_params.max_new_tokens", f"({req.sampling_params.max_new_tokens}) + the prompt "
                    f"({len(req.origin_input_ids)} tokens) {what} ({limit})")
        if req.priority is not None and cfg.abort_on_priority_when_disabled and not cfg.enable_priority_scheduling:
            return _PRIORITY_DISABLED
        return None

    def queue_error(self, req: Req) -> FinishReason | None:
        """The 503 for `req` joining a full waiting queue (--max-queued-requests) that it cannot
        displace anyone from; checked whenever a request joins the queue, as SGLang does."""
        cap = self.planner.cfg.max_queued_requests
        if cap is not None and len(self.planner.waiting) >= cap and self.queue_victim(req) is None:
            return _QUEUE_FULL
        return None

    def queue_victim(self, req: Req) -> Req | None:
        """The waiting request `req` displaces from a full queue: under --enable-priority-scheduling
        the least urgent one (SchedulePolicy.urgency, then newest) when `req` is strictly more urgent, as
        SGLang's _abort_on_queued_limit. None when the queue has room or `req` outranks nobody."""
        cfg, waiting = self.planner.cfg, self.planner.waiting
        if cfg.max_queued_requests is None or len(waiting) < cfg.max_queued_requests:
            return None
        if not cfg.enable_priority_scheduling or not waiting:
            return None
        urgency = self.planner.policy.urgency
        victim = min(waiting, key=lambda r: (urgency(r), -r.arrival_seq))
        return victim if urgency(req) > urgency(victim) else None

    # -- leaving early -----------------------------------------------------------------------------------
    def abort(self, group_prefixes: list[str], abort_all: bool, message: str = "") -> list[Req]:
        """An AbortReq: every choice of the named groups (or everything) ends, wherever it is."""
        reason = FinishReason(type="abort", message=message, status_code=200, err_type="abort")
        taken = self._take(abort_prefixes(group_prefixes, abort_all))
        if self.grammar_queue is not None:
            taken += self.grammar_queue.take(group_prefixes, abort_all)
        for req in taken:
            self._release(req, reason)
        return taken

    def _take(self, prefixes: tuple[str, ...]) -> list[Req]:
        """Remove and return every request the planner holds whose rid starts with one of
        `prefixes`; one pass over each queue however many match."""
        if not prefixes:
            return []
        planner = self.planner
        taken = [r for r in planner.waiting + planner.running if r.rid.startswith(prefixes)]
        if taken:
            gone = set(map(id, taken))
            planner.waiting = [r for r in planner.waiting if id(r) not in gone]
            planner.running = [r for r in planner.running if id(r) not in gone]
        if planner.chunked is not None and planner.chunked.req.rid.startswith(prefixes):
            taken.append(planner.chunked.req)
            planner.chunked = None
        return taken

    def expired_rids(self, now: float) -> list[str]:
        """Waiting requests older than --request-timeout that were never admitted (a retracted
        one has been served and waits for memory, not for service: it is not timed out)."""
        timeout = self.planner.cfg.request_timeout
        if not timeout:
            return []
        return [r.rid for r in self.planner.waiting
                if r.retract_count == 0 and now - r.created_monotonic > timeout]

    def expire(self, rids: list[str], timeout: float | None) -> None:
        """Finish the waiting requests the (rank 0's) clock timed out; one gone since is skipped."""
        if not rids:  # the common case: no scan of the waiting queue
            return
        timed_out = set(rids)
        for req in [req for req in self.planner.waiting if req.rid in timed_out]:
            self.finish(req, FinishReason(type="abort", status_code=503, err_type="ServiceUnavailable",
                                          message=f"request waited longer than --request-timeout ({timeout} s)"))

    # -- pause and continue (SGLang's pause_generation / continue_generation) ---------------------------
    def pause(self, mode: str) -> int:
        """Stop planning steps. `abort` ends every request, `retract` puts the ones holding KV back
        in the queue with their output kept, `in_place` leaves them as they are. Returns how many
        requests the pause touched."""
        if mode == "abort":
            touched = len(self.abort([], abort_all=True, message="generation was paused (mode abort)"))
        elif mode == "retract":
            touched = self.retract_all()
        else:
            touched = self.planner.num_running
        self.paused = True
        return touched

    def resume(self) -> None:
        self.paused = False

    def retract_all(self) -> int:
        reqs = self.planner.retract_all()
        for req in reqs:
            req.phase = Phase.WAITING
        return len(reqs)

    def holds_kv(self) -> bool:
        """Some request holds KV (running, or part-way through its prompt)."""
        return bool(self.planner.running) or self.planner.chunked is not None

    # -- steps -------------------------------------------------------------------------------------------
    def plan(self) -> ScheduleBatch | None:
        """The next step, numbered for launch; the phases follow the planner's choices."""
        if self.paused or self.memory_released:
            return None
        plan = self.planner.next_batch()
        for req in plan.retracted:
            req.phase = Phase.WAITING
        for req, reason in plan.aborted:
            self.finish(req, reason)
        batch = plan.batch
        if batch is None:
            return None
        chunked = self.planner.chunked.req if self.planner.chunked is not None else None
        for span in batch.spans:
            span.req.phase = Phase.CHUNKED if span.req is chunked else Phase.RUNNING
        batch.step_id = self.rows.on_launch()
        return batch

    def apply(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        """A finished step's results, in launch order: prompt rows, then each sampling request's
        tokens; a request that ended while the step was in flight takes none."""
        for task, chunk in result.input_logprob_chunks:
            if not (req := batch.reqs[task.req_index]).finished:
                req.input_logprobs.add_chunk(chunk, task.first_pos)  # type: ignore[union-attr]
        for task, rows in result.prompt_hidden_chunks:
            if not (req := batch.reqs[task.req_index]).finished:
                req.add_prompt_hidden(rows, task.first_pos, task.n)
        self.stats.count_generated(sum(map(len, result.next_token_ids)))
        batch.mark_processed()
        verified = _verified(batch, result)
        if verified:
            self.stats.record_verify([result.num_drafts[j] for j in verified],
                                     [result.next_token_ids[j] for j in verified])
        for j, req in enumerate(batch.sampling_reqs):
            if req.finished:
                continue
            tokens = result.next_token_ids[j]
            if j in verified:
                req.spec.record_verify(len(tokens) - 1)
            lp = result.output_logprobs[j] if result.output_logprobs else None
            hidden = result.output_hidden[j] if result.output_hidden else None
            done = apply_new_tokens(req, tokens, lp, hidden, self.checker)
            self.kv.commit(req)
            if done:
                self.finish(req, req.finished_reason)
            else:
                self.streamer.add(req)
        self.rows.on_processed(batch.step_id)

    # -- ending ------------------------------------------------------------------------------------------
    def finish(self, req: Req, reason: FinishReason | None) -> None:
        """End a request the planner holds (waiting, chunked or running)."""
        planner = self.planner
        if req.phase is Phase.RUNNING:
            planner.running.remove(req)
        elif req.phase is Phase.WAITING:
            planner.waiting.remove(req)
        elif req.phase is Phase.CHUNKED:
            planner.chunked = None
        self._release(req, reason)

    def _release(self, req: Req, reason: FinishReason | None) -> None:
        """The one way out: a request no queue holds any more gives its KV back and sends its last output."""
        req.finished_reason = reason
        req.phase = Phase.DONE
        self.kv.release(req)
        self.streamer.add(req)

    # -- outputs and visibility --------------------------------------------------------------------------
    def flush(self) -> BatchTokenIDOutput | None:
        """This iteration's outputs for the detokenizer (None: nothing to send)."""
        return self.streamer.build()

    @property
    def num_queued(self) -> int:
        return len(self.planner.waiting) + len(self.grammar_queue or ())

    def pending(self) -> str | None:
        """Why the cache may not be flushed now, or None when no request is anywhere. As SGLang's
        is_fully_idle, a request whose grammar is still compiling counts."""
        if not self.num_queued and not self.planner.has_work():
            return None
        return f"there are pending requests. #queue-req: {self.num_queued}, #running-req: {self.planner.num_running}"

    def flush_cache(self) -> str | None:
        """Drop the prefix cache when no request is anywhere (call it with no step in flight);
        otherwise why not, as `pending`."""
        if (busy := self.pending()) is None:
            self.kv.flush()
        return busy


def _verified(batch: ScheduleBatch, result: GenerationBatchResult) -> set[int]:
    """The sampling requests this verify step verified: those speculating in it (the ones the
    drafter drafts for), whatever the lookup found, as SGLang counts every request of its verify
    batch. One decoding plainly inside the pass (a grammar, penalties, hidden states, above the
    disable batch size) never enters SGLang's verify: counting it would report drafts never offered."""
    spec = batch.job.spec
    if not result.num_drafts or spec is None:
        return set()
    return {j for j, speculates in enumerate(spec.make_drafts) if speculates}

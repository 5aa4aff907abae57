"""Req: the scheduler's view of one choice of a generation request.

Its `rid` is internal (`{group}_{choice}`). `phase` changes only in SchedulerCore (core.py);
output state grows only through `result_processor.apply_new_tokens`; memory state
(`kv`) changes only through the KVManager; the
streaming cursors only through the OutputStreamer.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.ipc.messages import FinishReason, LogprobArrays, LogprobParams, TokenizedGenerateReq
from tandem.runtime.sampling.logprobs import InputLogprobAccumulator
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.scheduler.think import ReasoningState


@dataclass
class KVState:
    """A request's KV memory, written only by the KVManager: its row in ReqToTokenPool and how
    many of the row's positions hold allocated slots. Positions [0, committed_len) hold (or a
    step in flight is writing) the KV of known tokens; alloc_len equals committed_len except
    under speculation, which reserves slots ahead of need."""
    req_pool_idx: int | None = None
    alloc_len: int = 0
    committed_len: int = 0
    last_node: object | None = None  # the locked radix node covering the cached prefix


@dataclass
class StreamCursor:
    """What the OutputStreamer (its only writer) has sent: the first output with the per-request
    constants, then tokens, output logprob blocks and hidden-state blocks, and the input logprobs."""
    sent_any: bool = False
    tokens: int = 0
    logprobs: int = 0
    hidden: int = 0
    input_logprobs: bool = False


@dataclass
class SpecStats:
    """Speculative decoding, as SGLang counts it: verifies (decode steps the request drafted in;
    a plain decode inside a verify pass is none), drafts accepted, and how many verifies accepted
    0, 1, 2, ... drafts (spec_accept_histogram). Drafts proposed follow from the verify count."""
    verify_ct: int = 0
    accepted_drafts: int = 0
    accept_histogram: list[int] = field(default_factory=list)

    def record_verify(self, accepted: int) -> None:
        """One verify pass that kept `accepted` of its drafts."""
        self.verify_ct += 1
        self.accepted_drafts += accepted
        self.accept_histogram.extend([0] * (accepted + 1 - len(self.accept_histogram)))
        self.accept_histogram[accepted] += 1


class Phase(enum.Enum):
    """Where a request is: which queue holds it (see core.py for the transitions)."""
    COMPILING = "compiling"  # in the grammar queue
    WAITING = "waiting"  # in the planner's waiting queue (new, or retracted)
    CHUNKED = "chunked"  # its prompt is part-way through chunked prefill
    RUNNING = "running"  # decoding
    DONE = "done"  # finished or aborted: its KV is back


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool
    seed: int
    arrival_seq: int
    logprob: LogprobParams = field(default_factory=LogprobParams)
    return_hidden_states: bool = False
    priority: int | None = None  # None: the least urgent (SchedulePolicy.urgency)
    extra_key: str | None = None
    require_reasoning: bool = False  # the grammar starts after the think-end token
    # logit_bias as (ids int64, values float32), made once: a full-vocabulary bias must not cost
    # a Python loop every step
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None
    # stop_token_ids as a set, made once: the finish check looks every output token up in it, and
    # a list of the whole vocabulary cost a 49k-element scan per token (SGLang keeps a set too)
    stop_ids: frozenset[int] = frozenset()
    # output tokens the stop-string check decodes, worked out once (result_processor; 0: not yet)
    stop_window: int = 0
    stop_regex_window: int = 0  # the same for stop_regex

    phase: Phase = Phase.WAITING
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    # require_reasoning or max_thinking_tokens: where the output stands against the think end
    think: ReasoningState | None = None
    # guided decoding: an xgrammar matcher that has seen every output token after the reasoning
    # (retraction keeps the output, so it stays valid across it)
    grammar: Any | None = None

    kv: KVState = field(default_factory=lambda: KVState())
    # most tokens the planned but not yet processed steps can still add (1 per plain step,
    # 1 + drafts per verify): the planner's upper bound on the output length
    outputs_in_flight: int = 0
    spec: SpecStats = field(default_factory=lambda: SpecStats())
    cached_tokens: int = 0  # prompt tokens served from the radix cache (first prefill)
    retract_count: int = 0
    created_monotonic: float = field(default_factory=time.monotonic)

    # logprobs: input side accumulated over chunks; output side one block per kept token
    input_logprobs: InputLogprobAccumulator | None = None
    output_logprobs: list[LogprobArrays] = field(default_factory=list)
    # hidden states: [n, H] float32 blocks in position order, prompt rows first (positions
    # [logprob_start_len, P-1) when asked), then one row per kept output token
    hidden_states: list[np.ndarray] = field(default_factory=list)
    prompt_hidden_next: int = 0  # next prompt position whose hidden row is still to come

    cursor: StreamCursor = field(default_factory=lambda: StreamCursor())

    @staticmethod
    def from_message(msg: TokenizedGenerateReq, arrival_seq: int, default_seed: int) -> "Req":
        """`default_seed`: the seed when the request names none (the scheduler draws it from an RNG
        seeded by --random-seed, in arrival order, so every tensor-parallel rank draws the same)."""
        sp = msg.sampling_params
        seed = sp.sampling_seed if sp.sampling_seed is not None else default_seed
        req = Req(rid=msg.rid, origin_input_ids=np.asarray(msg.input_ids).tolist(), sampling_params=sp,
                  stream=msg.stream, seed=seed, arrival_seq=arrival_seq, logprob=msg.logprob,
                  return_hidden_states=msg.return_hidden_states, priority=msg.priority,
                  extra_key=msg.extra_key, require_reasoning=msg.require_reasoning)
        req.stop_ids = frozenset(sp.stop_token_ids)
        if sp.logit_bias:
            req.logit_bias = (np.fromiter(sp.logit_bias.keys(), np.int64, len(sp.logit_bias)),
                              np.fromiter(sp.logit_bias.values(), np.float32, len(sp.logit_bias)))
        lp = msg.logprob
        input_start = lp.input_start(len(req.origin_input_ids), sp.max_new_tokens)
        if input_start is not None:
            req.input_logprobs = InputLogprobAccumulator(req.origin_input_ids, input_start,
                                                         lp.top_logprobs_num, lp.token_ids_logprob)
        start = lp.logprob_start_len
        req.prompt_hidden_next = req.prompt_hidden_stop if start < 0 else min(start, req.prompt_hidden_stop)
        return req

    # -- derived views ----------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def in_reasoning(self) -> bool:
        """A require_reasoning request before its think end: its grammar does not apply yet."""
        return self.require_reasoning and self.think is not None and not self.think.over

    @property
    def reasoning_tokens(self) -> int:
        """SGLang's reasoning_tokens: counted for require_reasoning requests only."""
        return self.think.tokens if self.require_reasoning and self.think is not None else 0

    @property
    def return_logprob(self) -> bool:
        return self.logprob.return_logprob

    @property
    def needs_input_logprobs(self) -> bool:
        return self.input_logprobs is not None and not self.input_logprobs.done

    @property
    def prompt_hidden_stop(self) -> int:
        """Prompt hidden rows end before the last prompt position, whose row is output row 0."""
        return max(len(self.origin_input_ids) - 1, 0)

    @property
    def needs_prompt_hidden(self) -> bool:
        return self.return_hidden_states and self.prompt_hidden_next < self.prompt_hidden_stop

    def first_uncacheable_position(self) -> int:
        """Positions from here on must be computed, not served from the prefix cache: at least
        the last token (its logits sample the next one), and every prompt position whose
        logprobs or hidden state were asked for and have not been computed yet."""
        limit = self.seq_len - 1
        if self.needs_input_logprobs:
            limit = min(limit, self.input_logprobs.next_row)  # type: ignore[union-attr]
        if self.needs_prompt_hidden:
            limit = min(limit, self.prompt_hidden_next)
        return limit

    def max_total_len(self) -> int:
        return len(self.origin_input_ids) + self.sampling_params.max_new_tokens

    def add_prompt_hidden(self, rows: np.ndarray, first_pos: int, n: int) -> None:
        """Prompt hidden rows for positions [first_pos, first_pos + n), kept only when they are the
        next ones due (a chunk recomputed after retraction repeats rows already kept)."""
        if first_pos == self.prompt_hidden_next:
            self.hidden_states.append(rows)
            self.prompt_hidden_next += n



def abort_prefixes(group_prefixes: list[str], abort_all: bool) -> tuple[str, ...]:
    """The rid prefixes an AbortReq names: every request for abort_all, else each group's choices
    (`{group}_{i}`); empty prefixes name nothing. A request is aborted when its rid starts with one."""
    return ("",) if abort_all else tuple(p for p in group_prefixes if p)

"""Request state in the main process: one Call per /generate call (or Engine.generate), one
RequestGroup per logical request (the user's rid and its random internal group id), one
ChoiceState per choice, which also builds that choice's SGLang-shaped response."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.ipc.messages import BatchStrOutput, FinishReason, ReqCounters, SpecCounts
from tandem.runtime.frontend.text_pieces import TextPieces
from tandem.runtime.sampling.logprob_format import LogprobFormatter
from tandem.runtime.value_checks import ValidationError

# SGLang's INCREMENTAL_STREAMING_META_INFO_KEYS: the meta_info lists an incremental chunk slices
# (input logprobs, output_token_logprobs_length and hidden_states stay whole, as in SGLang's)
INCREMENTAL_META_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class RequestError(RuntimeError):
    """A request that ended with an error status (500/503) set by the scheduler or a dead child.
    A RuntimeError, as the Engine's own shutdown error, so embedding code catches both alike."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


class ClientDisconnected(Exception):
    """The HTTP client went away before its request finished (the request was aborted)."""


@dataclass(eq=False)
class ChoiceState:
    """One choice (`{group}_{i}`) of a logical request, as the response will show it."""

    rid: str  # internal
    group: RequestGroup
    index: int  # position in the response list
    prompt_tokens: int
    formatter: LogprobFormatter | None
    hidden_states: list[list[float]] | None  # None: not asked for
    prompt_token_ids: list[int] | None = None  # return_prompt_token_ids: the prompt's ids, as SGLang's
    pieces: TextPieces = field(default_factory=TextPieces)  # the answer text, as it arrived
    output_ids: list[int] = field(default_factory=list)
    counters: ReqCounters = field(default_factory=lambda: ReqCounters(completion_tokens=0, cached_tokens=0))
    finish_reason: FinishReason | None = None
    finished_at: float | None = None  # perf_counter when finish_reason arrived
    last_output: float | None = None  # perf_counter of the latest output (metrics)
    version: int = 0  # bumped on every update; streaming sends each version once
    weight_version: str = "default"  # of the weights that made the latest output
    # --incremental-streaming-output: how much of the text, output_ids and each sliced meta_info
    # list earlier chunks carried
    streamed_chars: int = 0
    streamed_ids: int = 0
    streamed_meta: dict[str, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The answer text so far (joined from its pieces when read)."""
        return self.pieces.whole()

    @text.setter
    def text(self, value: str) -> None:
        self.pieces = TextPieces(value)

    def text_from(self, start: int) -> str:
        """The answer text from character `start` on: O(that text), for readers with a cursor."""
        return self.pieces.since(start)

    def apply_output(self, msg: BatchStrOutput, i: int, now: float, weight_version: str) -> None:
        """Row i of a detokenizer output (this choice's): its text, token ids, counters, logprob
        rows and hidden states join the choice's, and its finish reason ends it."""
        new_ids = msg.new_token_ids[i].tolist()
        if new_ids:
            self.last_output, self.weight_version = now, weight_version
        self.pieces.append(msg.texts[i])
        self.output_ids.extend(new_ids)
        self.counters = msg.counters[i]
        if self.formatter is not None:
            if msg.input_logprobs and (lp := msg.input_logprobs[i]) is not None:
                self.formatter.extend_input(lp)
            if msg.output_logprobs and (lp := msg.output_logprobs[i]) is not None:
                self.formatter.extend_output(lp)
        if self.hidden_states is not None and msg.hidden_states and (rows := msg.hidden_states[i]) is not None:
            self.hidden_states.extend(rows.tolist())
        if msg.finished_reasons[i] is not None:
            self.finish_reason, self.finished_at = msg.finished_reasons[i], now

    def fail(self, reason: str, now: float) -> None:
        """End the choice with a server error (a child died)."""
        self.finish_reason = FinishReason(type="abort", status_code=500, err_type="InternalServerError", message=reason)
        self.finished_at = now
        self.changed()

    def changed(self) -> None:
        """A new version for its streams to send, and its call's waiters woken."""
        self.version += 1
        self.group.call.changed.set()

    def result(self) -> dict[str, Any]:
        return self._response(self.text, list(self.output_ids))

    def incremental_result(self) -> dict[str, Any]:
        """The next chunk of an --incremental-streaming-output stream: the text, output_ids and
        output logprob lists new since this choice's previous chunk (SGLang's
        slice_streaming_output_meta_info), so a client that joins the chunks has result()'s."""
        out = self._response(self.text_from(self.streamed_chars), self.output_ids[self.streamed_ids:])
        self.streamed_chars, self.streamed_ids = len(self.pieces), len(self.output_ids)
        meta = out["meta_info"]
        for key in INCREMENTAL_META_KEYS:
            if key in meta:
                full = meta[key]
                meta[key] = full[self.streamed_meta.get(key, 0):]
                self.streamed_meta[key] = len(full)
        return out

    def _response(self, text: str, output_ids: list[int]) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.group.logical_rid,
            "finish_reason": self.finish_reason.to_json() if self.finish_reason else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.counters.completion_tokens,
            "cached_tokens": self.counters.cached_tokens,
            "num_retractions": self.counters.retractions,
            "reasoning_tokens": self.counters.reasoning_tokens,
            "weight_version": self.weight_version,
        }
        if self.finished_at is not None:  # as SGLang's: a stream's earlier chunks have no latency yet
            meta["e2e_latency"] = round(self.finished_at - self.group.created, 6)
        if self.counters.spec is not None and self.finished:
            meta.update(spec_meta_info(self.counters.spec, self.counters.completion_tokens))
        if self.formatter is not None:
            meta.update(self.formatter.meta_info())
        if self.hidden_states is not None:
            meta["hidden_states"] = list(self.hidden_states)
        out: dict[str, Any] = {"text": text, "output_ids": output_ids, "meta_info": meta}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = list(self.prompt_token_ids)  # each result its own list, as output_ids
        if self.group.call.indexed:
            out["index"] = self.index
        return out

    def logprob_meta(self) -> dict[str, Any]:
        """The logprob keys of meta_info so far (empty when none were asked for)."""
        return self.formatter.meta_info() if self.formatter is not None else {}

    def error(self) -> RequestError | ValidationError | None:
        """The error this choice failed with: a ValidationError when the scheduler named the field
        (each surface renames it as for its own validation), else a RequestError."""
        fr = self.finish_reason
        if fr is None or fr.type != "abort" or fr.status_code in (None, 200):
            return None
        if fr.field is not None and fr.status_code == 400:
            return ValidationError(fr.field, fr.message or "is invalid")
        return RequestError(fr.status_code, fr.message or "request failed")


def spec_meta_info(spec: SpecCounts, completion_tokens: int) -> dict[str, Any]:
    """SGLang's fill_spec_decoding_meta: on a finished answer with at least one verify, the rate over
    every draft a verify proposes (no bonus), the length over verifies (the bonus counted), the counts
    under v0.5's names (spec_accept_token_num, spec_draft_token_num) and today's
    (spec_num_correct_drafts, spec_num_proposed_drafts), and the histogram when there is one."""
    if not spec.verify_ct or not spec.proposed:
        return {}
    meta: dict[str, Any] = {
        "spec_accept_rate": spec.accepted / spec.proposed, "spec_accept_length": completion_tokens / spec.verify_ct,
        "spec_verify_ct": spec.verify_ct, "spec_accept_token_num": spec.accepted,
        "spec_draft_token_num": spec.proposed, "spec_num_correct_drafts": spec.accepted,
        "spec_num_proposed_drafts": spec.proposed}
    if spec.accept_histogram:
        meta["spec_accept_histogram"] = list(spec.accept_histogram)
    return meta


def stream_error(item: dict[str, Any]) -> RequestError | None:
    """The error a streamed native chunk ends with, read by a client (the benches): SGLang
    streams a failed request's last chunk in the usual shape, its finish_reason an abort with an
    error status."""
    reason = (item.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") == "abort" and reason.get("status_code") not in (None, 200):
        return RequestError(reason["status_code"], reason.get("message") or "request failed")
    return None


@dataclass(eq=False)
class RequestGroup:
    """One logical request: the user's rid, its random internal group id, and its choices."""

    logical_rid: str
    group_id: str
    call: Call
    choices: list[ChoiceState] = field(default_factory=list)

    @property
    def created(self) -> float:
        """When the call arrived: latencies count tokenizing and validation too, as SGLang's."""
        return self.call.received

    @property
    def prefix(self) -> str:
        return f"{self.group_id}_"

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)


@dataclass(eq=False)
class Call:
    """One /generate call (or Engine.generate): its groups, in request order."""

    is_batch: bool
    indexed: bool  # the response items carry "index" (batch or n>1)
    received: float  # perf_counter when the call arrived, before it was tokenized
    log_metrics: bool = True  # False: health probes and SGLang's `log_metrics: false` stay out of /metrics
    groups: list[RequestGroup] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False  # its unfinished choices were aborted and its state dropped

    @property
    def choices(self) -> list[ChoiceState]:
        return [c for g in self.groups for c in g.choices]

    def first_error(self) -> RequestError | ValidationError | None:
        return next((err for c in self.choices if (err := c.error()) is not None), None)


class CallStream:
    """A streamed call's results (cumulative, or deltas with --incremental-streaming-output), each
    chunk with the choice it is of. A failed choice ends the stream with its last chunk in the
    usual shape (SGLang's: finish_reason an abort with the status); `error` holds that choice's
    error from then on. Closing the stream ends the call even when it was never iterated: a
    client can vanish between the response's start and its first chunk, and an async generator
    that never started never runs its `finally` (the request would run on, unaborted, its rid held)."""

    def __init__(self, items: AsyncGenerator[tuple[ChoiceState, Any], None], end: Callable[[], None]) -> None:
        self._items = items
        self._end = end
        self.error: RequestError | ValidationError | None = None

    def __aiter__(self) -> "CallStream":
        return self

    async def __anext__(self) -> Any:
        choice, item = await self._items.__anext__()
        self.error = choice.error()
        return item

    async def aclose(self) -> None:
        await self._items.aclose()
        self._end()

"""TokenizerManager (main process, asyncio): validates and tokenizes requests, sends them to the
scheduler, and assembles SGLang-shaped responses from the detokenizer's outputs."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from tandem.ipc.messages import (AbortReq, BatchStrOutput, ChildError, FinishReason, FlushCacheReply, FlushCacheReq,
                                 GetServerInfoReply, GetServerInfoReq, ReadyMsg, TokenizedGenerateReq)
from tandem.runtime.envs import envs
from tandem.runtime.launcher import READY_TIMEOUT_S, dead_child, spawn_children, stop_children
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.tokenizer import load_tokenizer
from tandem.ipc.sockets import IPCAddresses, async_recv, bind_pull, connect_push, send
from tandem.runtime.sampling.logprob_format import LogprobArrays, LogprobFormatOptions, LogprobFormatter
from tandem.runtime.server.validation import GenerateItem, ValidationError, check_rid_free, normalize_generate_request

logger = logging.getLogger("tandem.tokenizer_manager")


class RequestError(Exception):
    """A request that ended with an error status (400/500/503) set by the scheduler or a dead child."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message


@dataclass(eq=False)
class ReqState:
    rid: str
    logical_rid: str
    index: int
    indexed: bool  # the response carries "index" (batch or n>1)
    prompt_tokens: int
    formatter: LogprobFormatter | None
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    version: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.logical_rid,
            "finish_reason": self.finish_reason.to_json() if self.finish_reason else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": round(time.perf_counter() - self.created, 6),
        }
        if self.formatter is not None:
            meta.update(self.formatter.meta_info())
        out: dict[str, Any] = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
        if self.indexed:
            out["index"] = self.index
        return out

    def error(self) -> RequestError | None:
        fr = self.finish_reason
        if fr is not None and fr.type == "abort" and fr.status_code not in (None, 200):
            return RequestError(fr.status_code, fr.message or "request failed")
        return None


class TokenizerManager:
    """Owns the child processes of one server instance; create and `await start()` inside the serving loop."""

    def __init__(self, args: ServerArgs, on_child_death: Callable[[str], None] | None = None) -> None:
        self.args = args
        self.on_child_death = on_child_death
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        self.addrs = IPCAddresses.fresh()
        self.ctx = zmq.asyncio.Context()
        self.from_detok = bind_pull(self.ctx, self.addrs.detokenizer_to_tokenizer)
        self.from_scheduler = bind_pull(self.ctx, self.addrs.scheduler_to_tokenizer)
        self.to_scheduler = connect_push(self.ctx, self.addrs.tokenizer_to_scheduler)
        self.procs: list = []
        self.model_info: dict[str, Any] = {}
        self.states: dict[str, ReqState] = {}
        self._replies: asyncio.Queue = asyncio.Queue()
        self._control_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self.dead_reason: str | None = None

    async def start(self) -> None:
        """Spawn the children and wait until each reports ready (or fail loudly)."""
        self.procs = spawn_children(self.args, self.addrs)
        waiting = {"scheduler", "detokenizer"}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while waiting:
            if (dead := dead_child(self.procs)) is not None:
                raise RuntimeError(f"{dead.name} exited with code {dead.exitcode} during startup")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {', '.join(sorted(waiting))} to start")
            if not await self.from_scheduler.poll(200):
                continue
            msg = await async_recv(self.from_scheduler)
            if isinstance(msg, ChildError):
                raise RuntimeError(f"{msg.role} failed to start: {msg.message}")
            if isinstance(msg, ReadyMsg):
                waiting.discard(msg.role)
                if msg.role == "scheduler":
                    self.model_info = {"max_total_num_tokens": msg.max_total_tokens, "context_len": msg.context_len,
                                       "vocab_size": msg.vocab_size, "max_running_requests": msg.max_running_requests}
        self.vocab_size = self.model_info["vocab_size"]
        self.context_len = self.model_info["context_len"]
        self._tasks = [asyncio.ensure_future(self._detok_loop()),
                       asyncio.ensure_future(self._control_loop(self.from_scheduler)),
                       asyncio.ensure_future(self._watch_children())]

    async def _watch_children(self) -> None:
        interval = envs.HEALTH_CHECK_INTERVAL.get()
        while True:
            await asyncio.sleep(interval)
            dead = dead_child(self.procs)
            if dead is not None:
                reason = f"{dead.name} process died (exit code {dead.exitcode})"
                logger.error("%s; failing every in-flight request", reason)
                self.fail_all(reason)
                if self.on_child_death is not None:
                    self.on_child_death(reason)
                return

    # -- submission -------------------------------------------------------------------------------------
    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _submit(self, body: Any) -> tuple[bool, list[ReqState]]:
        if self.dead_reason:
            raise RequestError(500, self.dead_reason)
        norm = normalize_generate_request(body, vocab_size=self.vocab_size, context_len=self.context_len,
                                          tokenize=self._tokenize)
        running = {st.logical_rid for st in self.states.values()}
        for item in norm.items:
            check_rid_free(item.rid, running)
        states: list[ReqState] = []
        indexed = norm.is_batch or any(item.sampling_params.n > 1 for item in norm.items)
        for item in norm.items:
            for i in range(item.sampling_params.n):
                states.append(self._send(item, i, len(states), indexed))
        return norm.is_batch, states

    def _send(self, item: GenerateItem, choice: int, index: int, indexed: bool) -> ReqState:
        sp = item.sampling_params
        n = sp.n
        rid = item.rid if n == 1 else f"{item.rid}_{choice}"
        if n > 1:
            sp = msgspec.structs.replace(sp, n=1, sampling_seed=None if sp.sampling_seed is None else sp.sampling_seed + choice)
        formatter = None
        if item.return_logprob:
            options = LogprobFormatOptions(
                top_logprobs_num=item.top_logprobs_num,
                token_ids_logprob=tuple(item.token_ids_logprob) if item.token_ids_logprob else None,
                return_text_in_logprobs=item.return_text_in_logprobs,
                flat_input_top=item.return_flat_raw_top_logprobs,
                flat_output_top=item.return_flat_raw_output_top_logprobs,
                flat_b64=item.return_flat_raw_top_logprobs_b64)
            formatter = LogprobFormatter(options, self._decode_tokens, rid)
        state = ReqState(rid=rid, logical_rid=item.rid, index=index, indexed=indexed,
                         prompt_tokens=len(item.input_ids), formatter=formatter)
        self.states[rid] = state
        send(self.to_scheduler, TokenizedGenerateReq(
            rid=rid, input_ids=np.asarray(item.input_ids, dtype=np.int32), sampling_params=sp, stream=item.stream,
            return_logprob=item.return_logprob, logprob_start_len=item.logprob_start_len,
            top_logprobs_num=item.top_logprobs_num, token_ids_logprob=item.token_ids_logprob,
            priority=item.priority, extra_key=item.extra_key, created_time=time.time()))
        return state

    def _decode_tokens(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[i] for i in ids])

    # -- the two response shapes ----------------------------------------------------------------------------
    async def generate(self, body: Any, is_disconnected: Callable[[], Any] | None = None) -> dict | list[dict]:
        """Non-streaming: the finished result (a list for batch input or n > 1)."""
        is_batch, states = self._submit(body)
        try:
            for st in states:
                while not st.finished:
                    try:
                        await asyncio.wait_for(st.event.wait(), timeout=0.5)
                    except asyncio.TimeoutError:
                        pass
                    st.event.clear()
                    if not st.finished and is_disconnected is not None and await is_disconnected():
                        self.abort(st.logical_rid)
        except asyncio.CancelledError:
            self._abort_unfinished(states)
            raise
        for st in states:
            if (err := st.error()) is not None:
                raise err
        results = [st.result() for st in states]
        return results if (is_batch or len(results) > 1) else results[0]

    def generate_stream(self, body: Any) -> AsyncIterator[dict]:
        """Streaming: cumulative results as they grow; ends when every choice has finished.
        Validation runs now, before any byte of the stream is sent (so bad input is still a 400);
        a scheduler-initiated error becomes a final {"error": ...} event."""
        _, states = self._submit(body)
        return self._stream(states)

    async def _stream(self, states: list[ReqState]) -> AsyncIterator[dict]:
        sent = {id(st): 0 for st in states}  # version 0: nothing received yet
        try:
            while True:
                pending = [st for st in states if not (st.finished and sent[id(st)] == st.version)]
                if not pending:
                    return
                for st in states:
                    if sent[id(st)] != st.version:
                        sent[id(st)] = st.version
                        if (err := st.error()) is not None:
                            yield {"error": {"message": err.message, "code": err.status_code}}
                            continue
                        yield st.result()
                waiting = [st for st in states if not st.finished and sent[id(st)] == st.version]
                if waiting:
                    await asyncio.wait([asyncio.ensure_future(st.event.wait()) for st in waiting],
                                       return_when=asyncio.FIRST_COMPLETED)
                    for st in waiting:
                        st.event.clear()
        finally:
            self._abort_unfinished(states)  # client went away (or the consumer stopped early)

    def _abort_unfinished(self, states: list[ReqState]) -> None:
        for st in states:
            if not st.finished:
                self.abort(st.rid)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        send(self.to_scheduler, AbortReq(rid=rid, abort_all=abort_all))

    # -- receiving ------------------------------------------------------------------------------------------------
    async def _detok_loop(self) -> None:
        while True:
            msg = await async_recv(self.from_detok)
            if isinstance(msg, BatchStrOutput):
                self._apply(msg)

    def _apply(self, msg: BatchStrOutput) -> None:
        has_lp = bool(msg.output_token_logprobs_val) or bool(msg.input_token_logprobs_val)
        for i, rid in enumerate(msg.rids):
            st = self.states.get(rid)
            if st is None:
                continue
            st.text += msg.texts[i]
            st.output_ids.extend(msg.new_token_ids[i].tolist())
            st.completion_tokens = msg.completion_tokens[i]
            st.cached_tokens = msg.cached_tokens[i]
            if has_lp and st.formatter is not None:
                _extend_logprobs(st.formatter, msg, i)
            if msg.finished_reasons[i] is not None:
                st.finish_reason = msg.finished_reasons[i]
                del self.states[rid]
            st.version += 1
            st.event.set()

    async def _control_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            msg = await async_recv(sock)
            if isinstance(msg, ChildError):
                self.fail_all(f"{msg.role} failed: {msg.message}")
            else:
                await self._replies.put(msg)

    async def _control(self, request, reply_type: type, timeout: float = 30.0):
        async with self._control_lock:
            send(self.to_scheduler, request)
            while True:
                msg = await asyncio.wait_for(self._replies.get(), timeout)
                if isinstance(msg, reply_type):
                    return msg

    async def flush_cache(self) -> FlushCacheReply:
        return await self._control(FlushCacheReq(), FlushCacheReply)

    async def server_info(self) -> dict[str, Any]:
        reply: GetServerInfoReply = await self._control(GetServerInfoReq(), GetServerInfoReply)
        return {**reply.info, **{f"{p.name.removeprefix('tandem-')}_pid": p.pid for p in self.procs}}

    def fail_all(self, reason: str) -> None:
        """A child died: every in-flight request ends with an error now, and new ones are refused."""
        self.dead_reason = reason
        for st in list(self.states.values()):
            st.finish_reason = FinishReason(type="abort", status_code=500, err_type="InternalServerError", message=reason)
            st.version += 1
            st.event.set()
        self.states.clear()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        stop_children(self.procs)
        self.ctx.destroy(linger=0)
        self.addrs.cleanup()


def _extend_logprobs(fmt: LogprobFormatter, msg: BatchStrOutput, i: int) -> None:
    for side, extend in (("output", fmt.extend_output), ("input", fmt.extend_input)):
        vals = getattr(msg, f"{side}_token_logprobs_val")
        if not vals or vals[i] is None:
            continue
        tok = vals[i]
        null = int(np.argmax(~np.isnan(tok))) if len(tok) and np.isnan(tok[0]) else 0
        if null == 0 and len(tok) and np.isnan(tok).all():
            null = len(tok)
        extend(LogprobArrays(tok, getattr(msg, f"{side}_token_logprobs_idx")[i],
                             getattr(msg, f"{side}_top_logprobs_val")[i], getattr(msg, f"{side}_top_logprobs_idx")[i],
                             getattr(msg, f"{side}_token_ids_logprobs_val")[i], null))

"""TokenizerManager (main process, asyncio): validates and tokenizes requests, sends them to the
scheduler, and assembles SGLang-shaped responses from the detokenizer's outputs.

Request ids: the user's `rid` is a logical id that lives only here and in responses. Each
logical request gets a random internal group id of 16 hex digits; the scheduler and the
detokenizer only see `{group}_{i}`, one per choice. Abort by user rid is an exact lookup of the
logical rid, then one AbortReq with the group prefix. Every group ends when its handler ends,
whatever happened to it: unfinished choices are aborted once and their state is dropped.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from tandem.ipc.messages import AbortReq, BatchStrOutput, ChildError, ReadyMsg
from tandem.ipc.sockets import IPCAddresses, async_recv, bind_pull, connect_push, send
from tandem.runtime.envs import envs
from tandem.runtime.frontend.choice_requests import choice_requests
from tandem.runtime.frontend.control_calls import ControlCalls
from tandem.runtime.frontend.control_replies import ControlReplies
from tandem.runtime.frontend.metrics import ServerMetrics
from tandem.runtime.frontend.request_groups import (Call, CallStream, ChoiceState, ClientDisconnected, RequestError,
                                                    RequestGroup)
from tandem.runtime.frontend.request_log import finish_line
from tandem.runtime.frontend.validation import (GenerateItem, RequestLimits, check_rids_free,
                                                normalize_generate_request)
from tandem.runtime.launcher import READY_TIMEOUT_S, dead_child, spawn_children, stop_children
from tandem.runtime.model_files import chat_sampling_defaults, resolve_model_path
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.tokenizer import load_tokenizer, max_chars_per_token, read_chat_template, template_content_format

logger = logging.getLogger("tandem.tokenizer_manager")
DISCONNECT_POLL_S = 0.5
ABORT_GRACE_S = 5.0  # how long a shutdown waits for aborted requests to answer their clients
SHUTTING_DOWN = "the server is shutting down"


class ChildStartError(RuntimeError):
    """A child said why it could not start (a bad setting it found, or a failure it logged with its
    traceback): the message is the whole story, in one line."""
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
TEXT_CHARS_SLACK = 2  # a normalizer may shrink text before it is split into tokens


class TokenizerManager(ControlCalls):
    """Owns the child processes of one server instance; create and `await start()` inside the serving loop.
    Its control calls to the scheduler (flush_cache, server_info, weights, pause) are ControlCalls'."""

    def __init__(self, args: ServerArgs, on_child_death: Callable[[str], None] | None = None) -> None:
        self.args = args
        self.on_child_death = on_child_death
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        self.chat_template = read_chat_template(args.chat_template) if args.chat_template else None
        self.chat_content_format = template_content_format(self._default_chat_template())
        self.chat_sampling_defaults = _chat_sampling_defaults(args)
        self.addrs = IPCAddresses.fresh()
        self.ctx = zmq.asyncio.Context()
        self.from_detok = bind_pull(self.ctx, self.addrs.detokenizer_to_tokenizer)
        self.from_scheduler = bind_pull(self.ctx, self.addrs.scheduler_to_tokenizer)
        self.to_scheduler = connect_push(self.ctx, self.addrs.tokenizer_to_scheduler)
        self.procs: list[BaseProcess] = []
        self.model_info: dict[str, Any] = {}
        self.weight_version = args.weight_version  # of the weights served now (the front end's copy is the one)
        self.paused = False  # pause_generation until continue_generation
        self.groups: dict[str, RequestGroup] = {}  # live logical rid -> its group
        self.choices: dict[str, ChoiceState] = {}  # internal rid -> choice, until it finishes
        self._group_seq = 0
        self._replies = ControlReplies()
        # request validation / tokenizing and large response building, off the event loop
        self._validation_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-validate")
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop whose thread owns the sockets
        self.dead_reason: str | None = None
        self.last_output_at = 0.0  # time.monotonic() of the last output from the detokenizer
        self.num_outputs = 0  # outputs from the detokenizer: one per output the scheduler sent it
        self.draining = False
        self.metrics = ServerMetrics(args.served_model_name or args.model_path or DEFAULT_MODEL_NAME)

    @property
    def server_args(self) -> ServerArgs:
        """SGLang's name for the settings (`engine.tokenizer_manager.server_args`)."""
        return self.args

    async def start(self) -> None:
        """Spawn the children and wait until each reports ready (or fail loudly)."""
        self._loop = asyncio.get_running_loop()
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
                raise ChildStartError(f"{msg.role} failed to start: {msg.message}")
            if isinstance(msg, ReadyMsg):
                waiting.discard(msg.role)
                if msg.role == "scheduler":
                    self.model_info = {"max_total_num_tokens": msg.max_total_tokens, "context_len": msg.context_len,
                                       "vocab_size": msg.vocab_size, "max_running_requests": msg.max_running_requests,
                                       "architectures": [msg.architecture], "eos_token_ids": list(msg.eos_token_ids)}
        context_len, args = self.model_info["context_len"], self.args
        self.limits = RequestLimits(
            vocab_size=self.model_info["vocab_size"], context_len=context_len,
            max_total_tokens=self.model_info["max_total_num_tokens"] or None, max_batch_items=args.max_batch_items,
            max_top_logprobs_num=args.max_top_logprobs_num,
            max_text_chars=context_len * max_chars_per_token(self.tokenizer) * TEXT_CHARS_SLACK,
            guided_decoding=args.grammar_backend != "none", strict_thinking=args.enable_strict_thinking,
            reasoning_parser=args.reasoning_parser is not None, allow_auto_truncate=args.allow_auto_truncate)
        self._tasks = [asyncio.ensure_future(self._detok_loop()),
                       asyncio.ensure_future(self._control_loop(self.from_scheduler)),
                       asyncio.ensure_future(self._watch_children())]

    async def _watch_children(self) -> None:
        interval = envs.CHILD_WATCH_INTERVAL.get()
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

    def _default_chat_template(self) -> str | None:
        """The template render_chat uses (a tokenizer may name several: transformers takes "default")."""
        template = self.chat_template or self.tokenizer.chat_template
        return template.get("default") if isinstance(template, dict) else template

    def render_chat(self, messages: list[dict], template_kwargs: dict) -> str:
        """The prompt text of a chat: the tokenizer's chat template (or --chat-template's)."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  chat_template=self.chat_template, **template_kwargs)

    # -- submission -------------------------------------------------------------------------------------
    def _tokenizer_for(self, add_special_tokens: bool) -> Callable[[str], list[int]]:
        return lambda text: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def not_serving(self) -> str | None:
        """Why new requests are refused (a dead child, or draining after SIGTERM), else None."""
        return self.dead_reason or (SHUTTING_DOWN if self.draining else None)

    async def _submit(self, body: Any, add_special_tokens: bool = True, log_metrics: bool = True,
                      embedding: bool = False) -> Call:
        """Validate the whole call (off the event loop: tokenizing a long text takes a while),
        check its rids, then register and send every choice. A text prompt gets the tokenizer's
        special tokens (a BOS where the model has one), as SGLang tokenizes it; a rendered chat
        template has written them already. `log_metrics` False (or the body's SGLang
        `log_metrics: false`) keeps the call out of /metrics."""
        received = time.perf_counter()
        if self.dead_reason:
            raise RequestError(500, self.dead_reason)
        if embedding != self.args.is_embedding:
            raise RequestError(400, "this server serves an embedding model (--is-embedding): use /v1/embeddings or "
                               "/encode" if self.args.is_embedding else
                               "embeddings need a server started with --is-embedding")
        if self.draining:
            raise RequestError(503, SHUTTING_DOWN)
        norm = await asyncio.get_running_loop().run_in_executor(
            self._validation_pool, normalize_generate_request, body, self.limits,
            self._tokenizer_for(add_special_tokens))
        if self.dead_reason:
            raise RequestError(500, self.dead_reason)
        check_rids_free(norm.items, self.groups)
        log_metrics = log_metrics and not (isinstance(body, dict) and body.get("log_metrics") is False)
        call = Call(is_batch=norm.is_batch, received=received, log_metrics=log_metrics,
                    indexed=norm.is_batch or any(item.sampling_params.n > 1 for item in norm.items))
        for item in norm.items:
            call.groups.append(self._start_group(call, item))
        return call

    def _new_group_id(self) -> str:
        """Random (nothing about it can be derived from a user's rid), and unique within this
        process through a sequence number in its low half."""
        self._group_seq = (self._group_seq + 1) & 0xFFFFFFFF
        return f"{secrets.token_hex(4)}{self._group_seq:08x}"

    def _start_group(self, call: Call, item: GenerateItem) -> RequestGroup:
        group = RequestGroup(logical_rid=item.rid, group_id=self._new_group_id(), call=call)
        self.groups[item.rid] = group
        for choice, req in choice_requests(item, group, len(call.choices), self.weight_version, self._decode_tokens,
                                           self._priority(item)):
            group.choices.append(choice)
            self.choices[choice.rid] = choice
            send(self.to_scheduler, req)
        return group

    def _priority(self, item: GenerateItem) -> int | None:
        """SGLang's _set_default_priority: under priority scheduling, --default-priority-value stands
        for a priority the request does not name (unset: the scheduler's least urgent value)."""
        if item.priority is None and self.args.enable_priority_scheduling:
            return self.args.default_priority_value
        return item.priority

    def _decode_tokens(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode([[i] for i in ids])

    # -- the two response shapes ----------------------------------------------------------------------------
    async def generate(self, body: Any, is_disconnected: Callable[[], Any] | None = None,
                       add_special_tokens: bool = True, log_metrics: bool = True,
                       embedding: bool = False) -> dict | list[dict]:
        """Non-streaming: the finished result (a list for batch input or n > 1). The first choice
        that fails ends the whole call with its error (its siblings are aborted)."""
        call = await self._submit(body, add_special_tokens, log_metrics, embedding)
        await self._finish(call, is_disconnected)
        results = await self._results(call)
        return results if (call.is_batch or len(results) > 1) else results[0]

    async def generate_choices(self, body: Any, is_disconnected: Callable[[], Any] | None = None,
                               add_special_tokens: bool = True) -> list[ChoiceState]:
        """Non-streaming, for the front ends that render their own shape (OpenAI, Responses, gRPC):
        the finished choices in response order, their fields read directly (no result dicts)."""
        call = await self._submit(body, add_special_tokens)
        await self._finish(call, is_disconnected)
        return call.choices

    async def _finish(self, call: Call, is_disconnected: Callable[[], Any] | None) -> None:
        """Wait until every choice of `call` finished; the first that fails raises its error (its
        siblings are aborted), as does a client gone; the call ends either way."""
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        try:
            while not all(g.finished for g in call.groups):
                if (err := call.first_error()) is not None:
                    raise err
                try:
                    await asyncio.wait_for(call.changed.wait(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    pass
                call.changed.clear()
                if is_disconnected is not None and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + DISCONNECT_POLL_S
                    if await is_disconnected():
                        raise ClientDisconnected()
            if (err := call.first_error()) is not None:
                raise err
        finally:
            self._end_call(call)

    async def _results(self, call: Call) -> list[dict]:
        """The response items; built off the event loop when they carry logprobs or hidden
        states (hundreds of thousands of nested rows would stall every other request)."""
        if any(c.formatter is not None or c.hidden_states is not None for c in call.choices):
            return await asyncio.get_running_loop().run_in_executor(
                self._validation_pool, lambda: [c.result() for c in call.choices])
        return [c.result() for c in call.choices]

    async def generate_stream(self, body: Any, add_special_tokens: bool = True,
                              incremental: bool = False, typed: bool = False) -> CallStream:
        """Streaming: cumulative results as they grow; ends when every choice has finished.
        `incremental` (native /generate and the Engine under --incremental-streaming-output):
        each chunk carries only what is new since its choice's previous one. `typed` (the OpenAI,
        Responses and gRPC front ends): each item is the ChoiceState itself, read at once by a
        consumer that keeps its own cursors (no result dict is built).
        Validation runs now, before any byte of the stream is sent (so bad input is still a 400);
        a failed choice (scheduler-initiated, or a dead child) ends the stream with its last chunk,
        its finish_reason an abort with the status (and CallStream.error set), as SGLang's, and
        the other choices are aborted."""
        call = await self._submit(body, add_special_tokens)
        return CallStream(self._stream(call, incremental, typed), lambda: self._end_call(call))

    async def _stream(self, call: Call, incremental: bool,
                      typed: bool = False) -> AsyncGenerator[tuple[ChoiceState, Any], None]:
        sent = {id(c): 0 for c in call.choices}  # version 0: nothing received yet
        try:
            while True:
                for c in call.choices:
                    if sent[id(c)] != c.version:
                        sent[id(c)] = c.version
                        # a failure too, as SGLang: finish_reason abort with its status. A chunk is
                        # built when taken, so deltas a busy consumer missed join into it.
                        yield c, c if typed else c.incremental_result() if incremental else c.result()
                        if c.error() is not None:
                            return
                if all(c.finished and sent[id(c)] == c.version for c in call.choices):
                    return
                await call.changed.wait()
                call.changed.clear()
        finally:
            self._end_call(call)  # finished, failed, client gone, or the consumer stopped early

    def _end_call(self, call: Call) -> None:
        """Abort what is unfinished (one message for the whole call) and drop its state, once."""
        if call.ended:
            return
        call.ended = True
        unfinished = [g for g in call.groups if not g.finished]
        if unfinished and not self.dead_reason:
            send(self.to_scheduler, AbortReq(group_prefixes=[g.prefix for g in unfinished]))
        now = time.perf_counter()
        for group in call.groups:
            for c in group.choices:
                # unfinished: its abort output will find no choice, so it is counted here
                if self.choices.pop(c.rid, None) is not None and call.log_metrics:
                    self._count_finish(c, "abort", now)
            if self.groups.get(group.logical_rid) is group:
                del self.groups[group.logical_rid]

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown: refuse new requests (503), let running ones finish for up to
        `timeout` s, then end the rest with an abort whose message says why, and wait for their
        handlers to answer."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.groups and time.monotonic() < deadline and not self.dead_reason:
            await asyncio.sleep(0.05)
        if self.groups and not self.dead_reason:
            logger.warning("shutdown: ending %d request(s) still running after %g s", len(self.groups), timeout)
            send(self.to_scheduler, AbortReq(abort_all=True, message=SHUTTING_DOWN))
            deadline = time.monotonic() + ABORT_GRACE_S
            while self.groups and time.monotonic() < deadline and not self.dead_reason:
                await asyncio.sleep(0.05)

    def abort(self, rid: str = "", abort_all: bool = False) -> bool:
        """Abort one logical request by its exact rid (an unknown rid aborts nothing), or all.
        True when something was running to abort."""
        if abort_all:
            send(self.to_scheduler, AbortReq(abort_all=True))
            return bool(self.groups)
        if (group := self.groups.get(rid)) is not None:
            send(self.to_scheduler, AbortReq(group_prefixes=[group.prefix]))
            return True
        return False

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang's TokenizerManager.abort_request, which embedding programs call from their own
        thread or event loop (`engine.tokenizer_manager.abort_request(rid=...)`): off this manager's
        loop the abort is handed to it, since its ZMQ sockets belong to that loop's thread."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # a plain thread
            on_loop = False
        if on_loop or self._loop is None:
            self.abort(rid, abort_all)
        else:
            self._loop.call_soon_threadsafe(self.abort, rid, abort_all)

    # -- receiving ------------------------------------------------------------------------------------------------
    async def _detok_loop(self) -> None:
        while True:
            msg = await async_recv(self.from_detok)
            if isinstance(msg, BatchStrOutput):
                self.last_output_at = time.monotonic()
                self.num_outputs += 1
                self._apply(msg)

    def _apply(self, msg: BatchStrOutput) -> None:
        now = time.perf_counter()
        for i, rid in enumerate(msg.rids):
            c = self.choices.get(rid)
            if c is None:
                continue  # its call already ended
            counted = c.group.call.log_metrics
            if counted:
                self.metrics.on_output(now - c.group.created, None if c.last_output is None else now - c.last_output,
                                       len(msg.new_token_ids[i]))
            c.apply_output(msg, i, now, self.weight_version)
            if c.finish_reason is not None:
                del self.choices[rid]
                if counted:
                    self._count_finish(c, c.finish_reason.type, now)
                if self.args.log_requests:
                    logger.info(finish_line(c, self.args.log_requests_level))
            c.changed()

    def _count_finish(self, c: ChoiceState, finish_type: str, now: float) -> None:
        self.metrics.on_finish(finish_type, now - c.group.created, c.prompt_tokens, c.counters.completion_tokens,
                               c.counters.cached_tokens)

    def fail_all(self, reason: str) -> None:
        """A child died: every in-flight request ends with an error now, and new ones are refused."""
        self.dead_reason = reason
        self._replies.fail_all(reason)  # control requests waiting for the scheduler
        now = time.perf_counter()
        for c in list(self.choices.values()):
            c.fail(reason, now)
        self.choices.clear()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._validation_pool.shutdown(wait=False, cancel_futures=True)
        stop_children(self.procs)
        self.ctx.destroy(linger=0)
        self.addrs.cleanup()


def _chat_sampling_defaults(args: ServerArgs) -> dict[str, float | int]:
    if args.sampling_defaults != "model":
        return {}
    defaults = chat_sampling_defaults(resolve_model_path(args.model_path))
    logger.info("OpenAI chat sampling defaults (source %s): %s", "generation_config.json" if defaults else "the API",
                defaults or "temperature 1.0, top_p 1.0, top_k -1, min_p 0.0, repetition_penalty 1.0")
    return defaults

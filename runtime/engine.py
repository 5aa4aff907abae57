"""Engine: the embedded Python API, with the same semantics as /generate.

    with Engine() as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})

It starts the same scheduler and detokenizer processes as the server and runs the tokenizer
manager on its own event loop thread, so it works from plain scripts and from async code.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import functools
import logging
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from tandem.runtime import sglang_flags
from tandem.runtime.engine_rl import EngineRL
from tandem.runtime.launcher import resolve_random_seed
from tandem.runtime.model_files import local_checkpoints
from tandem.runtime.frontend.info import model_info, server_info
from tandem.runtime.frontend.validation import HANDLED_KEYS, IGNORED_KEYS, MEDIA_KEYS
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager
from tandem.runtime.value_checks import ValidationError, type_name

logger = logging.getLogger(__name__)
_STREAM_END = object()
SHUT_DOWN = "the Engine has been shut down"
GENERATE_KEYS = HANDLED_KEYS | IGNORED_KEYS | MEDIA_KEYS  # what generate() takes as keywords


async def _pump(tm: TokenizerManager, body: dict[str, Any], put: Callable[[Any], None],
                wanted: asyncio.Semaphore) -> None:
    """On the engine's loop: a chunk of a streamed call through `put` each time the consumer asks
    for one (`wanted`), then the error that ended it (re-raised on the caller's side), then
    _STREAM_END. A chunk is taken only when asked for, as SGLang's Engine takes it: while the
    consumer is busy its choice's results coalesce into the next, latest one (with
    --incremental-streaming-output, into one delta of everything since its previous chunk). The
    stream is closed however the pump ends (a cancel when the consumer stopped early aborts the
    request)."""
    stream = None
    try:
        stream = await tm.generate_stream(body, incremental=tm.args.incremental_streaming_output)
        while True:
            await wanted.acquire()
            put(await stream.__anext__())
    except StopAsyncIteration:
        pass
    except BaseException as exc:
        put(exc)
    finally:
        if stream is not None:
            await stream.aclose()
        put(_STREAM_END)


def _call_soon_unless_closed(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """`fn(*args)` on `loop`'s thread; dropped once `loop` has closed, where nobody is left to act
    on it (a consumer's asyncio.run that ended and closed its stream, whose pump ends on the
    engine's loop after that; or the engine's loop after shutdown), not raised where no one
    would catch it."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


@dataclasses.dataclass(frozen=True)
class FlushCacheReqOutput:
    """SGLang's answer to Engine.flush_cache(): `success` is False while requests are running."""
    success: bool
    message: str = ""

    def __bool__(self) -> bool:  # `if engine.flush_cache():` tells whether the cache was flushed
        return self.success


def _server_args(model_path: str | None, kwargs: dict[str, Any]) -> ServerArgs:
    """SGLang's Engine(**kwargs): the ServerArgs keywords, or a ready ServerArgs as `server_args`
    (alone: other keywords beside it would be ignored). As SGLang's, an Engine logs only errors
    unless given a log_level: it runs inside the user's program, not as a server."""
    if "server_args" in kwargs:
        args = kwargs.pop("server_args")
        if not isinstance(args, ServerArgs):
            raise TypeError(f"server_args must be a tandem ServerArgs, got {type(args).__name__}")
        if model_path is not None or kwargs:
            extra = ["model_path"] * (model_path is not None) + sorted(kwargs)
            raise TypeError(f"server_args cannot be combined with other arguments: {', '.join(extra)}")
        return args
    kwargs, notes = sglang_flags.engine_kwargs({"log_level": "error", **kwargs})
    for note in notes:
        logger.info(note)
    return ServerArgs(model_path=model_path, **kwargs)


class Engine(EngineRL):
    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        args = _server_args(model_path, kwargs)
        args = local_checkpoints(args)
        self.args = resolve_random_seed(args)  # once, before the schedulers start
        if self.args.node_rank > 0:
            raise ValueError(f"node_rank={self.args.node_rank}: nodes other than 0 run scheduler ranks only; "
                             f"start them with `tandem serve`, and the Engine on node 0")
        try:
            import uvloop

            self._loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
            self._loop = asyncio.new_event_loop()
        self._pending: set[concurrent.futures.Future] = set()  # calls handed to the loop, until done
        self._closed = False  # shutdown began: nothing more is handed to the loop
        self._lock = threading.Lock()  # orders a hand-over against shutdown's cancelling
        # at exit, while the loop thread still runs (as SGLang's Engine); weakly, so an Engine
        # dropped earlier is still collected
        self._at_exit = _shutdown_at_exit(weakref.ref(self))
        atexit.register(self._at_exit)
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-engine", daemon=True)
        self._thread.start()
        self.tm: TokenizerManager | None = None
        try:
            self.tm = self._run(self._start())
        except BaseException:
            self.shutdown()
            raise

    async def _start(self) -> TokenizerManager:
        tm = TokenizerManager(self.args)
        try:
            await tm.start()
        except BaseException:
            tm.close()
            raise
        return tm

    def _submit(self, coro) -> concurrent.futures.Future:
        """Hand a coroutine to the loop; shutdown cancels it if it is still pending then. After
        shutdown began it is refused: a stopped loop would never run it, and its caller would
        wait forever (a stream is handed over at its first iteration, perhaps long after)."""
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError(SHUT_DOWN)
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    def _run(self, coro):
        fut = self._submit(coro)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise RuntimeError(SHUT_DOWN) from None
        except BaseException:
            # the caller stopped waiting (Ctrl-C): its call ends too, an unfinished request is
            # aborted and its rid freed, as when an async caller is cancelled (no-op when done)
            fut.cancel()
            raise

    @staticmethod
    def _body(prompt: str | list[str] | None, sampling_params: dict | list[dict] | None,
              input_ids: list[int] | list[list[int]] | None, stream: bool, extra: dict[str, Any]) -> dict[str, Any]:
        """The /generate body of a call. Checked here, before a stream is returned: a keyword that
        is no /generate field is a TypeError, as SGLang's Engine signature makes it, and a stream
        flag that is no bool is refused (a truthy string would otherwise pick the streamed form)."""
        if unknown := sorted(set(extra) - GENERATE_KEYS):
            raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
        if not isinstance(stream, bool):
            raise ValidationError("stream", f"must be a boolean, got {type_name(stream)}")
        body: dict[str, Any] = {"stream": stream, **extra}
        if prompt is not None:
            if "text" in extra:  # /generate's name for the prompt: one of them would be dropped
                raise TypeError("give the prompt once: as prompt or as text, not both")
            body["text"] = prompt
        if input_ids is not None:
            body["input_ids"] = input_ids
        if sampling_params is not None:
            body["sampling_params"] = sampling_params
        return body

    # -- sync API -------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *, stream: bool = False,
                 **kwargs: Any) -> dict | list[dict] | Iterator[dict]:
        """Like POST /generate: a dict (a list for batch input or n > 1), or an iterator of
        chunks when stream=True (cumulative; deltas with incremental_streaming_output). The
        keywords are /generate's fields; past input_ids none is positional (SGLang's fourth is
        image_data, which would be taken for `stream` here)."""
        tm, body = self._live(), self._body(prompt, sampling_params, input_ids, stream, kwargs)
        if stream:
            return self._sync_stream(tm, body)
        return self._run(tm.generate(body))

    def _sync_stream(self, tm: TokenizerManager, body: dict[str, Any]) -> Iterator[dict]:
        import queue

        chunks: queue.Queue = queue.Queue()
        wanted = asyncio.Semaphore(0)
        fut = self._submit(_pump(tm, body, chunks.put, wanted))
        fut.add_done_callback(lambda f: f.cancelled() and chunks.put(RuntimeError(SHUT_DOWN)))
        try:
            while True:
                self._ask(wanted)
                if (item := chunks.get()) is _STREAM_END:
                    return
                if isinstance(item, BaseException):
                    raise RuntimeError(SHUT_DOWN) if isinstance(item, asyncio.CancelledError) else item
                yield item
        finally:
            fut.cancel()  # the consumer stopped early: the stream's cleanup aborts the request

    # -- async API -------------------------------------------------------------------------------------
    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, *, stream: bool = False,
                             **kwargs: Any) -> dict | list[dict] | AsyncIterator[dict]:
        tm, body = self._live(), self._body(prompt, sampling_params, input_ids, stream, kwargs)
        if stream:
            return self._async_stream(tm, body)
        fut = self._submit(tm.generate(body))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if fut.cancelled() and self.tm is None:  # shutdown cancelled it, not the caller
                raise RuntimeError(SHUT_DOWN) from None
            raise

    async def _async_stream(self, tm: TokenizerManager, body: dict[str, Any]) -> AsyncIterator[dict]:
        chunks: asyncio.Queue = asyncio.Queue()
        put = functools.partial(_call_soon_unless_closed, asyncio.get_running_loop(), chunks.put_nowait)
        wanted = asyncio.Semaphore(0)
        fut = self._submit(_pump(tm, body, put, wanted))
        fut.add_done_callback(lambda f: f.cancelled() and put(RuntimeError(SHUT_DOWN)))
        try:
            while True:
                self._ask(wanted)
                if (item := await chunks.get()) is _STREAM_END:
                    return
                if isinstance(item, BaseException):
                    raise RuntimeError(SHUT_DOWN) if isinstance(item, asyncio.CancelledError) else item
                yield item
        finally:
            fut.cancel()

    def _ask(self, wanted: asyncio.Semaphore) -> None:
        """A stream's consumer wants its next chunk (the pump on the engine's loop takes it then).
        Once shut down there is no pump to ask: the stream's queue holds the shutdown error."""
        _call_soon_unless_closed(self._loop, wanted.release)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort the request with exactly this rid (every choice of it), or every request."""
        self._live().abort_request(rid, abort_all)

    abort_request = abort  # SGLang's name (its Engine's, and its tokenizer manager's)

    def flush_cache(self) -> FlushCacheReqOutput:
        reply = self._run(self._live().flush_cache())
        return FlushCacheReqOutput(reply.success, reply.message)

    def get_server_info(self) -> dict[str, Any]:
        """What GET /server_info answers (SGLang's Engine.get_server_info)."""
        return self._run(server_info(self._live()))

    server_info = get_server_info

    def get_model_info(self) -> dict[str, Any]:
        """What GET /model_info answers."""
        return model_info(self._live())

    @property
    def server_args(self) -> ServerArgs:
        """SGLang's name for the Engine's settings (`engine.server_args.tp_size`, ...)."""
        return self.args

    @property
    def tokenizer_manager(self) -> TokenizerManager:
        """SGLang's name: `engine.tokenizer_manager.tokenizer` is the tokenizer."""
        return self._live()

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _live(self) -> TokenizerManager:
        """The tokenizer manager, checked in the caller's thread: after shutdown nothing may be
        scheduled on the stopped loop, where it would wait forever."""
        if self.tm is None:
            raise RuntimeError(SHUT_DOWN)
        return self.tm

    def shutdown(self) -> None:
        """Every call in flight (other threads, streams, async callers) ends with an error first;
        then the processes stop and the loop thread ends. A call handed to the loop too late to
        run is cancelled, so its caller wakes too."""
        with self._lock:
            self._closed = True
        atexit.unregister(self._at_exit)
        tm, self.tm = self.tm, None
        on_loop = threading.current_thread() is self._thread  # never wait on the loop from the loop
        if tm is not None and self._loop.is_running():
            closing = asyncio.run_coroutine_threadsafe(_close(tm), self._loop)
            if not on_loop:
                closing.result(timeout=60)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            if not on_loop:
                self._thread.join(timeout=10)
        for fut in list(self._pending):
            fut.cancel()
        if not on_loop and not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()  # its selector's fds (epoll, io_uring, self-pipe): one Engine after another leaked them

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:  # pragma: no cover - best effort when the user forgot shutdown()
        if sys.is_finalizing():  # the loop thread cannot run now; the atexit hook ran before
            return
        try:
            self.shutdown()
        except Exception:
            pass


def _shutdown_at_exit(engine: "weakref.ref[Engine]") -> Callable[[], None]:
    def hook() -> None:
        if (alive := engine()) is not None:
            alive.shutdown()
    return hook


async def _close(tm: TokenizerManager) -> None:
    tm.fail_all(SHUT_DOWN)  # each call waiting for tokens wakes with this error
    await asyncio.sleep(0)  # and runs before the sockets and processes go
    # what else is pending (a prompt being validated, a control request awaiting the scheduler)
    # is cancelled: its caller wakes with the shutdown error instead of waiting forever
    others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    tm.close()

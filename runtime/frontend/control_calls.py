"""The tokenizer manager's control calls to the scheduler (flush the cache, server info, weight
operations, pause and continue): each sends one request and waits for the reply with its req_id.

A mixin of TokenizerManager, which owns the sockets, the ControlReplies and the event loop these
use; its control loop hands every reply to the ControlReplies, and a child's failure fails every
call still waiting.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import zmq.asyncio

from tandem.ipc.messages import (ChildError, ControlReply, FlushCacheReply, FlushCacheReq, GetServerInfoReply,
                                 GetServerInfoReq, PauseReq, WeightsReq)
from tandem.ipc.sockets import async_recv, send
from tandem.runtime.frontend.control_replies import ControlReplies
from tandem.runtime.frontend.request_groups import RequestError

CONTROL_TIMEOUT_S = 10.0
# a weight update waits for the running requests and may read gigabytes; a trainer joins its group in its own time
WEIGHTS_TIMEOUT_S = 900.0


class ControlCalls:
    """The control half of TokenizerManager (its attributes below are the manager's)."""

    if TYPE_CHECKING:
        to_scheduler: zmq.asyncio.Socket
        procs: list[BaseProcess]
        weight_version: str
        paused: bool
        dead_reason: str | None
        _replies: ControlReplies
        _loop: asyncio.AbstractEventLoop | None

        def fail_all(self, reason: str) -> None: ...

    async def _control_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            msg = await async_recv(sock)
            if isinstance(msg, ChildError):
                self.fail_all(f"{msg.role} failed: {msg.message}")
            elif isinstance(msg, (FlushCacheReply, GetServerInfoReply, ControlReply)):
                self._replies.deliver(msg)

    async def _control(self, make_request: Callable[[int], Any], timeout: float = CONTROL_TIMEOUT_S):
        """Send a control request and wait for the reply with its req_id; 503 after `timeout`,
        at once when a child has died (none would answer). Awaited from another event loop (an
        embedding program's `await engine.tokenizer_manager.flush_cache()`), it runs on this
        manager's loop: the reply, set there, would not wake the caller's loop until its timeout."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            return await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._control(make_request, timeout), self._loop))
        if self.dead_reason:
            raise RequestError(500, self.dead_reason)
        return await self._replies.ask(lambda msg: send(self.to_scheduler, msg), make_request, timeout)

    async def flush_cache(self) -> FlushCacheReply:
        return await self._control(lambda req_id: FlushCacheReq(req_id=req_id))

    async def weights(self, op: str, fields: dict[str, Any], weight_version: str | None = None) -> ControlReply:
        """A weight operation (frontend/weights.py builds `fields`); a successful update that names a
        weight_version makes it the served version."""
        reply: ControlReply = await self._control(lambda req_id: WeightsReq(req_id=req_id, op=op, **fields),
                                                  WEIGHTS_TIMEOUT_S)
        if reply.success and weight_version is not None:
            self.weight_version = weight_version
        return reply

    async def pause(self, mode: str) -> ControlReply:
        """SGLang's pause_generation (abort | retract | in_place), or continue_generation ("continue")."""
        reply: ControlReply = await self._control(lambda req_id: PauseReq(req_id=req_id, mode=mode))
        self.paused = mode != "continue"
        return reply

    async def server_info(self, timeout: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        reply: GetServerInfoReply = await self._control(lambda req_id: GetServerInfoReq(req_id=req_id), timeout)
        return {**reply.info, **{f"{p.name.removeprefix('tandem-')}_pid": p.pid for p in self.procs}}


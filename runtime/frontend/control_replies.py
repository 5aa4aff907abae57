"""Control requests waiting for the scheduler's reply (flush_cache, server_info), matched by req_id.

Invariant: each pending req_id has one future until its asker stops waiting (answered, timed
out or failed); a reply for a req_id nobody waits for any more is dropped. When a child dies,
every waiting asker fails at once: none of them would get an answer.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tandem.runtime.frontend.request_groups import RequestError


class ControlReplies:
    def __init__(self) -> None:
        self._waiting: dict[int, asyncio.Future] = {}
        self._seq = 0

    async def ask(self, send_request: Callable[[Any], None], make_request: Callable[[int], Any],
                  timeout: float) -> Any:
        """Send the request `make_request(req_id)` and wait for its reply; 503 after `timeout`."""
        self._seq += 1
        req_id = self._seq
        fut = self._waiting[req_id] = asyncio.get_running_loop().create_future()
        try:
            send_request(make_request(req_id))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise RequestError(503, f"the scheduler did not answer within {timeout:g} s") from None
        finally:
            del self._waiting[req_id]

    def deliver(self, reply: Any) -> None:
        """A reply (it carries its req_id) to the asker still waiting for it, if any."""
        fut = self._waiting.get(reply.req_id)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def fail_all(self, reason: str) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(RequestError(500, reason))

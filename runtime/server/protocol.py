"""uvicorn's h11 protocol with a deadline for the request head.

uvicorn closes idle keep-alive connections only after a response, so a client that connects and
never sends (or trickles) a request head holds a connection forever; 4000 of them were enough to
starve the server. Here every connection must deliver a complete request head within
`--http-read-timeout` seconds of connecting (or of its previous response); the body has the same
deadline in the route that reads it.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutH11Protocol(H11Protocol):
    head_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._cancel_head_timer()  # a request head arrived; the route bounds its body

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()  # waiting for the next request on a keep-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_with_head_timeout(seconds: float) -> type[HeadTimeoutH11Protocol]:
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,), {"head_timeout_s": seconds})

"""ZMQ plumbing: per-instance ipc:// addresses and PUSH/PULL helpers over the one codec.

Receivers bind (PULL), senders connect (PUSH). High-water marks are 0 (unbounded) so a slow
consumer never makes a sender drop or block on a message.

The main process runs asyncio: it builds its PULL sockets from a ``zmq.asyncio.Context`` with
the same ``bind_pull`` and reads them with ``async_recv``. Its PUSH sockets may be plain
(sync ``send``: a connected PUSH with HWM 0 queues without waiting) or asyncio
(``async_send``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import zmq
import zmq.asyncio

from tandem.ipc.codec import decode, encode
from tandem.ipc.messages import Message

__all__ = [
    "IPCAddresses",
    "bind_pull",
    "connect_push",
    "send",
    "recv",
    "recv_all_nowait",
    "async_recv",
    "async_send",
]

# Unix socket paths are limited to ~107 bytes (sun_path); stay well below.
_MAX_SOCKET_PATH = 100
# Long enough to flush a final message (e.g. ChildError) before a child exits, short enough
# that a dead peer cannot hang shutdown.
DEFAULT_PUSH_LINGER_MS = 1000


@dataclass(frozen=True)
class IPCAddresses:
    """The ipc:// endpoints of one server instance. Picklable: passed to spawned children."""

    root: str
    tokenizer_to_scheduler: str
    scheduler_to_detokenizer: str
    detokenizer_to_tokenizer: str
    scheduler_to_tokenizer: str

    @classmethod
    def fresh(cls) -> IPCAddresses:
        """Make a new private temp dir and the four socket addresses inside it."""
        root = tempfile.mkdtemp(prefix=f"tandem-{os.getpid()}-")
        if len(root) + 8 > _MAX_SOCKET_PATH:
            # a long $TMPDIR (macOS) would overflow sun_path; /tmp is short everywhere
            os.rmdir(root)
            root = tempfile.mkdtemp(prefix=f"tandem-{os.getpid()}-", dir="/tmp")

        def addr(name: str) -> str:
            return f"ipc://{os.path.join(root, name)}"

        return cls(
            root=root,
            tokenizer_to_scheduler=addr("t2s"),
            scheduler_to_detokenizer=addr("s2d"),
            detokenizer_to_tokenizer=addr("d2t"),
            scheduler_to_tokenizer=addr("s2t"),
        )

    def cleanup(self) -> None:
        """Remove the temp dir and any socket files in it; safe to call twice."""
        shutil.rmtree(self.root, ignore_errors=True)


def bind_pull(ctx: zmq.Context | zmq.asyncio.Context, addr: str) -> zmq.Socket:
    """A PULL socket bound at ``addr`` (receivers bind)."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    # nothing to flush on a receiver; never let close wait
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def connect_push(
    ctx: zmq.Context | zmq.asyncio.Context,
    addr: str,
    linger_ms: int = DEFAULT_PUSH_LINGER_MS,
) -> zmq.Socket:
    """A PUSH socket connected to ``addr``; HWM 0 and a bounded linger."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.connect(addr)
    return sock


def send(sock: zmq.Socket, msg: Message) -> None:
    """Encode and send one message (non-blocking in practice: HWM 0)."""
    # copy=False lets pyzmq hand large buffers to libzmq without another copy
    sock.send(encode(msg), copy=False)


def recv(sock: zmq.Socket, block: bool = True) -> Message | None:
    """Receive and decode one message; ``None`` if ``block`` is False and none is queued."""
    try:
        frame = sock.recv(0 if block else zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    # decoding the frame's buffer lets arrays view the received bytes without a copy
    return decode(frame.buffer)


def recv_all_nowait(sock: zmq.Socket) -> list[Message]:
    """Drain every message already queued on ``sock`` without blocking."""
    out: list[Message] = []
    while True:
        msg = recv(sock, block=False)
        if msg is None:
            return out
        out.append(msg)


async def async_recv(sock: zmq.asyncio.Socket) -> Message:
    """Await and decode one message from a zmq.asyncio socket."""
    frame = await sock.recv(copy=False)
    return decode(frame.buffer)


async def async_send(sock: zmq.asyncio.Socket, msg: Message) -> None:
    """Encode and send one message on a zmq.asyncio socket."""
    await sock.send(encode(msg), copy=False)

"""`tandem serve` / `python -m tandem.launch.server`: start the HTTP server and its child processes.

SIGTERM (or Ctrl-C) drains: new requests get a 503, running ones have
`--graceful-shutdown-timeout` seconds to finish, the rest end with an abort that says the
server is shutting down, then the server exits 0. A second signal exits at once. A signal
during the startup (a model load, a TP rendezvous) ends it at once: the children stop, exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn
from fastapi import FastAPI

from tandem.runtime import sglang_flags
from tandem.runtime.launcher import resolve_random_seed, run_scheduler_node
from tandem.runtime.model_files import local_checkpoints
from tandem.runtime.process import setup_logging
from tandem.runtime.server.http import create_app
from tandem.runtime.server.protocol import protocol_with_head_timeout
from tandem.runtime.server_args import ServerArgs


class PortInUse(Exception):
    pass


def take_port(host: str, port: int, flag: str) -> socket.socket:
    """Bind and listen on `host:port` now, before any child starts. Bound alone, a port is not
    taken: with SO_REUSEADDR a second server binds the same port until one listens, loads its
    model, says it is ready and never serves; and uvicorn would bind only after the startup (model
    load, TP rendezvous), when gloo's or anyone's ephemeral sockets may have it. Connections that
    arrive during the startup wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may bind over TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} is in use ({flag} {port} on {host}): another server listens there") from None
        raise PortInUse(f"cannot listen on {host}:{port} ({flag}): {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout = drain_timeout
        self.draining = False
        self.stopped_starting = False
        # uvicorn reports a cancelled startup as a failure (the CancelledError's traceback, then
        # "Application startup failed"): a stop the operator asked for is neither; and a child that
        # refused to start has said why in one line (run_server logs it), which a traceback would bury
        logging.getLogger("uvicorn.error").addFilter(
            lambda record: not (self.stopped_starting or getattr(app.state, "start_error", None)))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # replaces uvicorn's: no re-raise of the signal after a clean drain, so the exit status is 0
        if self.draining or not self.started:
            self.force_exit = self.should_exit = True
            startup = getattr(self.app.state, "startup", None)
            if startup is not None:  # uvicorn looks at should_exit only once the startup returns
                logging.warning("signal %s during the startup: stopping", signal.Signals(sig).name)
                self.stopped_starting = True
                asyncio.get_event_loop().call_soon_threadsafe(startup.cancel)
            return
        self.draining = True
        logging.warning("signal %s: draining (up to %g s)", signal.Signals(sig).name, self.drain_timeout)
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        tm = getattr(self.app.state, "tm", None)
        if tm is not None:
            await tm.drain(self.drain_timeout)
        self.should_exit = True


def run_server(args: ServerArgs, notes: Sequence[str] = ()) -> int:
    """`notes`: lines to log once logging is set up (SGLang flags that were ignored)."""
    setup_logging("main", args.log_level)
    for note in notes:
        logging.info(note)
    args = resolve_random_seed(args)  # before anything reads it: /server_info reports the drawn seed
    if args.node_rank > 0:  # schedulers only: node 0 serves HTTP, tokenizes and detokenizes
        return run_scheduler_node(args)
    died: list[str] = []
    server: uvicorn.Server | None = None

    def on_child_death(reason: str) -> None:
        died.append(reason)
        if server is not None:
            server.should_exit = True  # in-flight requests already got their error responses

    app = create_app(args, on_child_death)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, loop="uvloop",
                            http=protocol_with_head_timeout(args.http_read_timeout), timeout_keep_alive=5,
                            limit_concurrency=args.max_connections, timeout_graceful_shutdown=5, access_log=False,
                            log_config=None)  # uvicorn's lines reach the root logger: the one format
    server = DrainingServer(config, app, args.graceful_shutdown_timeout)
    try:
        sock = take_port(args.host, args.port, "--port")
    except PortInUse as exc:
        logging.error("tandem serve: %s", exc)
        return 1
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's exit when the startup failed; a stop asked for is no failure
        if start_error := getattr(app.state, "start_error", None):
            logging.error("tandem serve: %s", start_error)
            return 1
        if not server.stopped_starting:
            raise
    if died:
        logging.error("tandem server stopped: %s", died[0])
        return 1
    return 0 if server.started or server.stopped_starting else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve", description="Serve a model over SGLang's native HTTP API")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:  # a bad value exits as argparse's errors do (usage, the flag and why; status 2), no traceback
        notes = sglang_flags.check(ns)
        args = ServerArgs.from_cli_args(ns)
        args = local_checkpoints(args)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    return run_server(args, notes)


if __name__ == "__main__":
    sys.exit(main())

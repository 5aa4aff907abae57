"""Spawning and watching the child processes (scheduler, detokenizer)."""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing.process import BaseProcess

from tandem.ipc.sockets import IPCAddresses
from tandem.runtime.server_args import ServerArgs

READY_TIMEOUT_S = 600.0


def _scheduler_main(args: ServerArgs, addrs: IPCAddresses) -> None:
    # imported in the child only: the main process never imports torch or model code
    from tandem.runtime.scheduler.scheduler import run_scheduler_process

    run_scheduler_process(args, addrs)


def _detokenizer_main(args: ServerArgs, addrs: IPCAddresses) -> None:
    from tandem.runtime.detokenizer import run_detokenizer_process

    run_detokenizer_process(args, addrs)


def spawn_children(args: ServerArgs, addrs: IPCAddresses) -> list[BaseProcess]:
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_scheduler_main, args=(args, addrs), name="tandem-scheduler", daemon=True),
        ctx.Process(target=_detokenizer_main, args=(args, addrs), name="tandem-detokenizer", daemon=True),
    ]
    for p in procs:
        p.start()
    return procs


def stop_children(procs: list[BaseProcess], timeout: float = 5.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(1.0)


def dead_child(procs: list[BaseProcess]) -> BaseProcess | None:
    return next((p for p in procs if not p.is_alive()), None)

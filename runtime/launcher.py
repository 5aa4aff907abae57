"""Spawning and watching the child processes (scheduler, detokenizer), from the main process.
The children's side of the watch is runtime/process.py."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import signal
import socket
import time
from multiprocessing.process import BaseProcess

from tandem.ipc.sockets import IPCAddresses
from tandem.runtime.process import ParentWatch, node_tp_ranks, set_title
from tandem.runtime.server_args import ServerArgs

READY_TIMEOUT_S = 600.0


def _scheduler_main(args: ServerArgs, addrs: IPCAddresses, parent_pid: int, tp_rank: int) -> None:
    set_title("scheduler" if args.tp_size == 1 else f"scheduler_tp{tp_rank}")
    watch = ParentWatch(parent_pid, addrs)
    # imported in the child only: the main process never imports torch or model code
    from tandem.runtime.scheduler.scheduler import run_scheduler_process

    run_scheduler_process(args, addrs, watch, tp_rank)


def _detokenizer_main(args: ServerArgs, addrs: IPCAddresses, parent_pid: int) -> None:
    set_title("detokenizer")
    watch = ParentWatch(parent_pid, addrs)
    from tandem.runtime.detokenizer import run_detokenizer_process

    run_detokenizer_process(args, addrs, watch)


def resolve_random_seed(args: ServerArgs) -> ServerArgs:
    """`args` with the seed drawn when none was given, as SGLang's random.randint(0, 1 << 30), so
    seedless sampling differs from launch to launch. Drawn once, in the main process, before the
    schedulers start: every TP rank samples the same token with it. A node of a multi-node job
    leaves it 0: its ranks take node 0's when they join (tp_sync.ADOPTED_FIELDS), as SGLang's."""
    if args.random_seed is not None:
        return args
    seed = 0 if args.nnodes > 1 else random.randint(0, 1 << 30)
    logging.info("random seed: %d (%s; --random-seed sets it)", seed,
                 "other nodes take node 0's" if args.nnodes > 1 else "drawn for this launch")
    return args.replace(random_seed=seed)


def spawn_children(args: ServerArgs, addrs: IPCAddresses) -> list[BaseProcess]:
    """A scheduler per tensor-parallel rank of this node; node 0 also runs the detokenizer."""
    ctx = mp.get_context("spawn")
    me = os.getpid()
    args = resolve_random_seed(args)  # the front ends resolved it already; this is for direct callers
    if args.tp_size > 1 and args.dist_init_addr is None:  # one node: rendezvous on a free local port
        args = args.replace(dist_init_addr=f"127.0.0.1:{free_port()}")
    procs = [ctx.Process(target=_scheduler_main, args=(args, addrs, me, rank), daemon=True,
                         name="tandem-scheduler" if args.tp_size == 1 else f"tandem-scheduler-tp{rank}")
             for rank in node_tp_ranks(args)]
    if args.node_rank == 0:
        procs.append(ctx.Process(target=_detokenizer_main, args=(args, addrs, me), name="tandem-detokenizer",
                                 daemon=True))
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_scheduler_node(args: ServerArgs) -> int:
    """Nodes other than 0 (--node-rank > 0): this node's scheduler ranks and nothing else. Returns
    when one of them dies (1: a dead rank ends the job; its peers' collectives fail on every
    node) or on SIGTERM / SIGINT (0)."""
    addrs = IPCAddresses.fresh()  # unused sockets: only rank 0 talks to a tokenizer manager
    procs = spawn_children(args, addrs)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    try:
        while not stopping:
            if (dead := dead_child(procs)) is not None:
                logging.error("%s exited with code %s: stopping node %d", dead.name, dead.exitcode, args.node_rank)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        stop_children(procs)
        addrs.cleanup()

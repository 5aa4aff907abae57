"""What a child process (scheduler, detokenizer) runs on its side of the launcher: its title, its
log format (the one every tandem process uses), the watch on its parent, and which
tensor-parallel ranks its node runs.

Children never outlive the main process: on Linux the kernel sends them SIGUSR1 when it dies
(PR_SET_PDEATHSIG; a signal nothing else sends them, so the handler knows what happened without
racing the kernel's reparenting), and their loops also check for a new parent every iteration,
busy or idle. Whoever outlives the main process removes the IPC directory.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

from tandem.ipc.sockets import IPCAddresses
from tandem.runtime.server_args import ServerArgs

_PR_SET_PDEATHSIG = 1
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"  # SGLang's


def log_format(role: str) -> str:
    """`[2026-12-07 10:00:00 INFO scheduler] message`: time, level, which process."""
    return f"[%(asctime)s %(levelname)s {role.replace('%', '%%')}] %(message)s"


def setup_logging(role: str, level: str) -> None:
    """Every tandem process logs the same way (log_format) on stderr, at --log-level: the main
    process (`main`, uvicorn's lines included), `scheduler` (`scheduler TP<rank>` under tensor
    parallelism) and `detokenizer`, so one server's interleaved output reads as one log."""
    logging.basicConfig(level=level.upper(), format=log_format(role), datefmt=LOG_DATEFMT)


class ParentWatch:
    """In a child: notices the main process's death and then cleans up after it."""

    def __init__(self, parent_pid: int, addrs: IPCAddresses) -> None:
        self.parent_pid = parent_pid
        self.addrs = addrs
        signal.signal(signal.SIGUSR1, self._on_parent_death)
        if sys.platform == "linux":
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1)
        if self.parent_gone():  # it died before prctl took effect
            self.exit_orphaned()

    def parent_gone(self) -> bool:
        return os.getppid() != self.parent_pid

    def exit_orphaned(self) -> None:
        self.addrs.cleanup()
        os._exit(1)  # the forward thread may be mid-step: do not wait for it

    def _on_parent_death(self, signum: int, frame: object) -> None:
        self.exit_orphaned()


def node_tp_ranks(args: ServerArgs) -> range:
    """The tensor-parallel ranks this node runs: tp_size / nnodes consecutive ones."""
    per_node = args.tp_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def set_title(role: str) -> None:
    """`tandem::<role>` in ps, top and /proc/<pid>/cmdline (SGLang's sglang::scheduler form), so a
    person can tell the processes apart."""
    import setproctitle

    setproctitle.setproctitle(f"tandem::{role}")

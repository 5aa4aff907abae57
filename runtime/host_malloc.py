"""glibc malloc settings for a process that runs the model on CPU: freed large blocks stay in the
heap for the next step instead of going back to the kernel.

By default glibc serves a block above its mmap threshold (adaptive, at most 32 MiB) with a fresh
mapping and unmaps it on free, and a thread other than the main one allocates from an arena
whose heaps (64 MiB at most) cannot hold such a block at all, and shrink as blocks are freed.
So every large activation of a forward pass would arrive as untouched pages and page-fault its
way in, 4 KiB at a time, at every step.

Invariant: one arena for the whole process (the forward thread allocates from the main heap,
where the raised thresholds apply), blocks up to 1 GiB come from that heap, and the heap is
trimmed only past 1 GiB of free space at its top. Memory stays at the process's peak instead of
breathing with every step; a serving process sits at its peak anyway.
"""
from __future__ import annotations

import ctypes
import logging
import sys

from tandem.runtime.envs import envs

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_KEEP_BYTES = 1 << 30

_applied = False


def keep_freed_heap() -> bool:
    """Apply the settings once per process (glibc only; TANDEM_CPU_MALLOC_KEEP=0: never). Call it
    before the process starts threads, so none has an arena of its own yet. True when applied."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux") or not envs.CPU_MALLOC_KEEP.get():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: nothing to tune
        return False
    ok = all(mallopt(param, value) == 1 for param, value in
             ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _KEEP_BYTES), (_M_TRIM_THRESHOLD, _KEEP_BYTES)))
    if not ok:
        logger.warning("glibc refused a malloc setting: large CPU activations may page-fault every step")
    _applied = ok
    return ok


def release_freed_heap() -> None:
    """Give the heap's free pages back to the kernel now (release_memory_occupation: the process
    is below its peak on purpose, which keep_freed_heap's thresholds would otherwise hide)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # another libc: its own policy
            pass

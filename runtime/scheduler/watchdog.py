"""Watchdog: a scheduler that makes no progress for `--watchdog-timeout` seconds (a forward step
that never returns, a deadlock) dumps every thread's stack and exits non-zero, so the main
process fails the in-flight requests loudly instead of hanging them forever.

Progress is a loop iteration: an idle scheduler iterates every 500 ms, a busy one every step.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

logger = logging.getLogger("tandem.scheduler")


class Watchdog:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last = time.monotonic()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="tandem-watchdog", daemon=True).start()

    def feed(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            stalled = time.monotonic() - self._last
            if stalled > self.timeout_s:
                logger.error("watchdog: the scheduler made no progress for %.0f s (--watchdog-timeout %g); "
                             "thread stacks follow, then the scheduler exits", stalled, self.timeout_s)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(1)

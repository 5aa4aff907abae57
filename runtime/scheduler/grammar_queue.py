"""GrammarQueue: requests whose grammar is still compiling.

A constrained request waits here, not in the planner's queue, until its grammar is ready, so a
slow compile never holds up anyone else; then it gets its own matcher (applied after the think
end for a `require_reasoning` request: Req.in_reasoning) and joins the waiting queue. A compile
error or `--grammar-compile-timeout` ends it with a 400 quoting xgrammar.
Under TP every rank compiles its own grammars, but which requests leave the queue in an
iteration is rank 0's decision (`settled`), applied alike on every rank (`settle`).
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

from tandem.ipc.messages import FinishReason
from tandem.runtime.grammar.backend import GrammarBackend
from tandem.runtime.scheduler.request import Req, abort_prefixes


@dataclass
class _Waiting:
    req: Req
    compiled: Future
    deadline: float


def grammar_size_error(constraint: tuple[str, str], max_bytes: int) -> FinishReason | None:
    """The 400 for a constraint over --max-grammar-bytes: compile time and memory grow with its
    size (a 24 KB schema compiles to 7.5 MB against a 49k vocabulary), so one client's huge
    schema is refused before it takes a compile thread."""
    kind, text = constraint
    size = len(text.encode())
    if size <= max_bytes:
        return None
    return FinishReason.bad_request(f"sampling_params.{kind}",
                                    f"is {size} bytes, over --max-grammar-bytes ({max_bytes})")


class GrammarQueue:
    def __init__(self, backend: GrammarBackend, timeout_s: float) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self._waiting: list[_Waiting] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: Req) -> None:
        kind, text = req.sampling_params.constraint  # type: ignore[misc]
        self._waiting.append(_Waiting(req, self.backend.compile(kind, text), time.monotonic() + self.timeout_s))

    def poll(self) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """Requests whose grammar is ready (each with its own matcher), and those that failed."""
        return self.settle(*self.settled())

    def settled(self) -> tuple[list[str], list[str]]:
        """The rids whose compile has finished, and those past --grammar-compile-timeout: under TP
        only rank 0 asks (tp_sync shares its answer), since each rank compiles at its own pace."""
        now = time.monotonic()
        done = [w.req.rid for w in self._waiting if w.compiled.done()]
        expired = [w.req.rid for w in self._waiting if not w.compiled.done() and now > w.deadline]
        return done, expired

    def settle(self, done: list[str], expired: list[str]) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """Exactly these requests leave the queue, in queue order: `done` ones (waiting for this
        rank's own compile, which rank 0 saw finish) ready or failed by its outcome, `expired` ones
        failed; rids no longer here (aborted since) are skipped."""
        done_set, expired_set = set(done), set(expired)
        ready: list[Req] = []
        failed: list[tuple[Req, FinishReason]] = []
        still: list[_Waiting] = []
        for w in self._waiting:
            kind = w.req.sampling_params.constraint[0]  # type: ignore[index]
            if w.req.rid in done_set:
                exc = w.compiled.exception()  # blocks until this rank's compile is done too
                if exc is None:
                    w.req.grammar = self.backend.matcher(w.compiled.result())
                    ready.append(w.req)
                else:
                    failed.append((w.req, FinishReason.bad_request(
                        f"sampling_params.{kind}", f"does not compile: {self.backend.error_message(exc)}")))
            elif w.req.rid in expired_set:
                failed.append((w.req, FinishReason.bad_request(
                    f"sampling_params.{kind}",
                    f"did not compile within --grammar-compile-timeout ({self.timeout_s:g} s)")))
            else:
                still.append(w)
        self._waiting = still
        self._release([req for req, _ in failed])
        return ready, failed

    def take(self, group_prefixes: list[str], abort_all: bool) -> list[Req]:
        prefixes = abort_prefixes(group_prefixes, abort_all)
        if not prefixes:
            return []
        taken = [w.req for w in self._waiting if w.req.rid.startswith(prefixes)]
        self._waiting = [w for w in self._waiting if not w.req.rid.startswith(prefixes)]
        self._release(taken)
        return taken

    def _release(self, gone: list[Req]) -> None:
        """Grammars that only requests now gone were waiting for: the backend may drop them."""
        still_wanted = {w.req.sampling_params.constraint for w in self._waiting}
        for key in {req.sampling_params.constraint for req in gone} - still_wanted:
            self.backend.release(*key)  # type: ignore[misc]

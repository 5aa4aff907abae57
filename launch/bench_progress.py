"""Progress for the long benchmarks: a tqdm bar on stderr over the runs still to come, named by
the one running now, and each table row on stdout the moment it is measured, so a bench shows
where it is and a stopped one has printed every row it finished.

The bar draws only where stderr is a terminal (TANDEM_BENCH_PROGRESS=1 forces it on, 0 off):
stdout carries the table alone, and a log file gets no carriage-return frames.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from tqdm import tqdm

ENV = "TANDEM_BENCH_PROGRESS"


def progress_enabled(disable: bool = False) -> bool:
    """Whether to draw a bar: never with `disable`, else as TANDEM_BENCH_PROGRESS says, else
    where stderr is a terminal."""
    if disable:
        return False
    forced = os.environ.get(ENV)
    if forced is not None:
        return forced not in ("", "0")
    return sys.stderr.isatty()


def bar(total: int, desc: str, unit: str = "run", disable: bool = False) -> tqdm:
    """A tqdm bar on stderr (see the module's note on when it draws)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not progress_enabled(disable),
                dynamic_ncols=True, leave=False)


class Progress:
    """A bar over a bench's runs: `with progress.step("name"):` around each one."""

    def __init__(self, total: int, desc: str, disable: bool = False) -> None:
        self.bar = bar(total, desc, disable=disable)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.bar.set_postfix_str(what)
        yield
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def emit(line: str = "") -> None:
    """Print one line (a table row) on stdout now, above any live bar."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()

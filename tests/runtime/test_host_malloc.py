"""glibc keeps freed large blocks for reuse once `keep_freed_heap` ran: a forward-sized activation
allocated again and again on a worker thread stops page-faulting, where glibc's defaults map and
unmap it every time.

Run in child interpreters: malloc settings are process state.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import resource, sys, threading
    import torch
    from tandem.runtime.host_malloc import keep_freed_heap

    applied = keep_freed_heap()  # first, as the scheduler process does, before any thread
    x = torch.ones(12 << 20)  # 48 MB: an fp32 prefill chunk's activation
    faults = []

    def steps():  # on a thread, as the forward worker runs
        for _ in range(20):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            y = x * 2
            del y
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    thread = threading.Thread(target=steps)
    thread.start()
    thread.join()
    print(int(applied), sum(faults[-5:]))  # the heap has grown to its working size by then (5-8 steps)
""")


def _run(keep: bool) -> tuple[bool, int]:
    env = {**os.environ, "TANDEM_CPU_MALLOC_KEEP": str(int(keep))}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "1", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.timeout(240)
def test_freed_activations_are_reused_not_refaulted() -> None:
    applied, kept_faults = _run(keep=True)
    off, default_faults = _run(keep=False)
    assert applied and not off
    assert default_faults > 0  # the pathology is there to remove (4 KiB pages: ~12,000 per step)
    assert kept_faults * 10 <= default_faults, (kept_faults, default_faults)

"""The forward thread owns the intra-op threads; the scheduler thread that loaded the model keeps
one. The forward thread packs the weights, under its own count, before its first step.

Run in a child interpreter: thread counts are process state and would leak into other tests.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import threading
    import torch
    torch.set_num_threads(2)  # as on a 2-core machine, whatever this one has
    from tandem.runtime.scheduler.forward_worker import ForwardWorker, reserve_intra_op_threads
    from tandem.runtime.scheduler.stats import StepStats

    threads = reserve_intra_op_threads()
    assert threads == 2, threads
    assert torch.get_num_threads() == 1
    torch.mm(torch.randn(512, 512), torch.randn(512, 512))  # the model load's work stays on one thread
    class Runner:
        packed_on = None
        device = torch.device("cpu")
        def pack_weights(self):  # MKL's fp32 packs keep the thread count they were made under
            Runner.packed_on = (threading.current_thread().name, torch.get_num_threads())
    worker = ForwardWorker(Runner(), None, None, StepStats(), None, threads)
    assert Runner.packed_on == ("tandem-forward", 2), Runner.packed_on
    worker.run = lambda job: torch.get_num_threads()  # what the forward thread runs with
    assert worker.submit(None).result(timeout=30) == 2
    # torch starts a thread from the last count any thread set: the scheduler thread must keep its own
    torch.mm(torch.randn(512, 512), torch.randn(512, 512))
    assert torch.get_num_threads() == 1, torch.get_num_threads()
    class Broken:
        device = torch.device("cpu")
        def pack_weights(self):
            raise MemoryError("no room for the packed weights")
    try:
        ForwardWorker(Broken(), None, None, StepStats(), None, threads)
    except MemoryError as exc:  # the scheduler's start-up fails, and reports it
        assert "no room" in str(exc)
    else:
        raise AssertionError("a failed pack must fail the worker's start")
    print("ok")
""")


@pytest.mark.timeout(60)
def test_forward_thread_takes_the_intra_op_threads() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

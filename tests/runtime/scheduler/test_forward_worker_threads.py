"""The forward thread owns the intra-op threads; the scheduler thread that loaded the model keeps
one. The forward thread packs the weights, under its own count, before its first step. The
overlap schedule runs unless those threads take every CPU of a CPU device.

The worker runs in a child interpreter: thread counts are process state and would leak into other tests.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tandem.runtime.scheduler.forward_worker import overlap_schedule_on
from tandem.runtime.server_args import ServerArgs

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


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("args, device, threads, cpus, on", [
    (ServerArgs(), CPU, 2, 2, False),  # the forward's threads take every CPU: nothing to overlap on
    (ServerArgs(), CPU, 4, 2, False),
    (ServerArgs(), CPU, 2, 4, True),  # CPUs to spare (hyperthreads, OMP_NUM_THREADS, TP ranks on fewer cores)
    (ServerArgs(), CUDA, 16, 16, True),  # a device apart from the CPU: always
    (ServerArgs(enable_cpu_overlap_schedule=True), CPU, 2, 2, True),
    (ServerArgs(disable_overlap_schedule=True), CPU, 2, 4, False),
    (ServerArgs(disable_overlap_schedule=True), CUDA, 16, 16, False),
])
def test_overlap_schedule_is_off_where_the_cpu_device_has_no_core_to_spare(args, device, threads, cpus, on) -> None:
    resolved, why = overlap_schedule_on(args, device, threads, cpus)
    assert resolved is on
    assert why  # logged at start-up


def test_the_overlap_flags_contradict_each_other() -> None:
    with pytest.raises(ValueError, match="--disable-overlap-schedule and --enable-cpu-overlap-schedule"):
        ServerArgs(disable_overlap_schedule=True, enable_cpu_overlap_schedule=True)

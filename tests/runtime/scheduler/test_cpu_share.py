"""CpuShare: one intra-op thread fewer for each core other processes keep busy, all back once free."""
from __future__ import annotations

from tandem.runtime.scheduler.cpu_share import CHECK_INTERVAL_S, CpuShare, machine_busy_s


class FakeMachine:
    """A clock and the CPU seconds of the machine and of this process, advanced by hand."""

    def __init__(self) -> None:
        self.now = self.machine = self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += seconds * own_cores
        self.machine += seconds * (own_cores + other_cores)

    def share(self, max_threads: int) -> CpuShare:
        return CpuShare(max_threads, clock=lambda: self.now, machine=lambda: self.machine, own=lambda: self.own)


def test_threads_follow_the_cores_others_keep_busy():
    m = FakeMachine()
    share = m.share(4)
    m.run(1.0, own_cores=4, other_cores=0)
    assert share.threads() == 4
    m.run(1.0, own_cores=3, other_cores=1.0)  # one busy process
    assert share.threads() == 3
    m.run(1.0, own_cores=2, other_cores=1.8)
    assert share.threads() == 2
    m.run(1.0, own_cores=1, other_cores=7.0)  # more than every core: one thread stays
    assert share.threads() == 1
    m.run(1.0, own_cores=4, other_cores=0.3)  # the server's own HTTP process at a busy moment
    assert share.threads() == 4


def test_the_count_holds_between_checks_and_one_thread_never_changes():
    m = FakeMachine()
    share = m.share(2)
    m.run(CHECK_INTERVAL_S / 4, own_cores=1, other_cores=1)
    assert share.threads() == 2  # too soon to judge
    m.run(CHECK_INTERVAL_S, own_cores=1, other_cores=1)
    assert share.threads() == 1
    m.run(CHECK_INTERVAL_S / 4, own_cores=2, other_cores=0)
    assert share.threads() == 1
    single = m.share(1)
    m.run(2.0, own_cores=0, other_cores=2)
    assert single.threads() == 1


def test_unreadable_proc_keeps_every_thread():
    m = FakeMachine()
    share = CpuShare(2, clock=lambda: m.now, machine=lambda: None, own=lambda: m.own)
    m.run(2.0, own_cores=1, other_cores=1)
    assert share.threads() == 2


def test_the_machine_counter_reads_this_machine():
    first = machine_busy_s()
    assert first is not None and first > 0
    sum(i * i for i in range(2_000_000))  # some CPU time of our own
    assert machine_busy_s() > first

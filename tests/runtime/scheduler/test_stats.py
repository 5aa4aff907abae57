"""StepStats: the generation throughput that /get_server_info, /v1/loads and /metrics report."""

from __future__ import annotations

import pytest

from tandem.runtime.scheduler import stats as stats_mod
from tandem.runtime.scheduler.stats import StepStats


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(stats_mod.time, "monotonic", c)
    return c


def test_a_short_burst_reports_its_own_rate(clock: _Clock) -> None:
    # 101 steps of 8 tokens, 1 ms apart: 800 tokens in 0.1 s after the first step
    s = StepStats()
    for _ in range(101):
        s.count_generated(8)
        clock.now += 0.001
    assert s.gen_throughput() == pytest.approx(8000, rel=1e-6)


def test_the_rate_holds_while_idle_and_follows_the_next_burst(clock: _Clock) -> None:
    s = StepStats()
    assert s.gen_throughput() == 0.0
    for _ in range(11):
        s.count_generated(4)
        clock.now += 0.01
    clock.now += 60  # idle: the last rate stays, as SGLang's last_gen_throughput does
    assert s.gen_throughput() == pytest.approx(400, rel=1e-6)
    for _ in range(11):
        s.count_generated(2)
        clock.now += 0.01
    assert s.gen_throughput() == pytest.approx(200, rel=1e-6)  # the old burst left the window

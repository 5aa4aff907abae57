"""The long benchmarks print each table row the moment it is measured (a row is out before the
next configuration starts) and draw their progress bar on stderr only, so stdout stays the table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.launch import bench_progress


class StdoutLog:
    """What the bench has printed so far, read from inside its stubbed runs."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys, self.out, self.err = capsys, "", ""

    def now(self) -> str:
        got = self.capsys.readouterr()
        self.out, self.err = self.out + got.out, self.err + got.err
        return self.out


def _row_lines(out: str, first_word: str) -> list[str]:
    return [line for line in out.splitlines() if line.split()[:1] == [first_word]]


@pytest.mark.parametrize("env, tty, disable, drawn", [
    (None, True, False, True), (None, False, False, False), ("1", False, False, True), ("0", True, False, False),
    ("1", True, True, False),
])
def test_the_bar_draws_on_a_terminal_or_when_forced(monkeypatch, env, tty, disable, drawn):
    if env is None:
        monkeypatch.delenv(bench_progress.ENV, raising=False)
    else:
        monkeypatch.setenv(bench_progress.ENV, env)
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty)
    assert bench_progress.progress_enabled(disable) is drawn


def test_offline_prints_each_row_before_the_next_system_runs(monkeypatch, tmp_path: Path, capsys):
    from tandem.launch import bench_offline as bo

    log = StdoutLog(capsys)
    seen: dict[str, str] = {}  # the stdout each run started with

    def result(name: str, seconds: float):
        def run(args, wl, *rest, **kw):
            seen[name] = log.now()
            return bo.SystemResult(name, wl.output_tokens, seconds, wl.output_tokens)
        return run

    engine = {True: result("tandem (overlap on)", 1.0), False: result("tandem (overlap off)", 2.0)}
    monkeypatch.setenv(bench_progress.ENV, "1")
    monkeypatch.setattr(bo, "model_vocab", lambda path: 1000)
    monkeypatch.setattr(bo, "gemm_bound", lambda args, wl: bo.SystemResult(
        "GEMM-only bound", wl.output_tokens, 0.1, wl.output_tokens, info={"decode_batch": 4, "decode_tok_s": 4.0}))
    monkeypatch.setattr(bo, "run_engine", lambda args, wl, overlap: engine[overlap](args, wl))
    monkeypatch.setattr(bo, "run_bare", result("bare loop", 0.5))
    monkeypatch.setattr(bo, "run_transformers", result("transformers generate", 4.0))
    out = tmp_path / "r.json"
    assert bo.main(["--num-seqs", "4", "--output-file", str(out)]) == 0
    log.now()
    # when each run started, every row measured before it was printed, and nothing after it
    assert "GEMM-only bound" in seen["tandem (overlap off)"] and "tandem (overlap" not in seen["tandem (overlap on)"]
    assert "tandem (overlap on)" in seen["bare loop"] and "tandem (overlap off)" in seen["bare loop"]
    assert "bare loop" in seen["transformers generate"] and "tandem / bare" not in seen["transformers generate"]
    assert "transformers generate" in log.out and "tandem / bare" in log.out
    # the bar went to stderr, named by the run in progress; stdout has no bar frames
    assert "bench offline" in log.err and "transformers" in log.err
    assert "\r" not in log.out and "bench offline" not in log.out
    assert json.loads(out.read_text())["tandem_over_bare"] == 0.5


def test_tp_prints_each_size_before_the_next_runs(monkeypatch, capsys):
    from tandem.launch import bench_tp

    log = StdoutLog(capsys)
    seen: dict[int, str] = {}

    def run_tp(args, tp, wl):
        seen[tp] = log.now()
        return {"tp_size": tp, "output_tokens": wl.output_tokens, "seconds": 1.0, "tok_s": 10.0 / tp, "steps": 3,
                "comm_ms_per_step": 0.0, "comm_share": 0.0}

    monkeypatch.setattr(bench_tp, "check_tp_sizes", lambda parser, args: type("Cfg", (), {"vocab_size": 1000}))
    monkeypatch.setattr(bench_tp, "run_tp", run_tp)
    assert bench_tp.main(["--tp-sizes", "1", "2", "4", "--num-seqs", "2"]) == 0
    log.now()
    assert [len(_row_lines(seen[tp], str(prev))) for tp, prev in ((2, 1), (4, 2))] == [1, 1]
    assert not _row_lines(seen[1], "1") and "comm ms/step" in seen[1]  # the header came first
    assert [line.split()[0] for line in log.out.splitlines()[-3:]] == ["1", "2", "4"]


def test_prefix_prints_the_cache_on_row_before_the_off_run(monkeypatch, capsys):
    from tandem.launch import bench_prefix as bp

    log = StdoutLog(capsys)
    seen: dict[bool, str] = {}

    def run_mode(args, groups, radix, progress=None):
        seen[radix] = log.now()
        for _ in groups:
            progress.update(1)
        timing = bp.ReqTiming(0.01, 72, 4, 64 if radix else 0)
        return bp.ModeResult("radix cache on" if radix else "radix cache off", [timing] * 6, 1.0)

    monkeypatch.setenv(bench_progress.ENV, "1")
    monkeypatch.setattr(bp, "model_vocab", lambda path: 1000)
    monkeypatch.setattr(bp, "run_mode", run_mode)
    assert bp.main(["--num-groups", "2", "--prompts-per-group", "3", "--prefix-len", "8"]) == 0
    log.now()
    assert "radix cache on" in seen[False] and "radix cache on" not in seen[True]
    assert "TTFT speedup" in log.out and "bench prefix" in log.err and "\r" not in log.out


@pytest.mark.timeout(300)
def test_one_batch_prints_each_batch_before_the_next(tiny_model_dir, monkeypatch, capsys):
    """The real bench on the tiny model (each row's GEMM bound measured with it)."""
    from tandem.launch import bench_one_batch

    log = StdoutLog(capsys)
    seen: list[str] = []
    real_run = bench_one_batch.run

    def run(runner, batch_size, input_len, output_len, seed=0):
        seen.append(log.now())
        return real_run(runner, batch_size, input_len, output_len, seed)

    monkeypatch.setattr(bench_one_batch, "run", run)
    assert bench_one_batch.main(["--model-path", tiny_model_dir("llama"), "--batch-size", "1", "2",
                                 "--input-len", "8", "--output-len", "4", "--dtype", "float32"]) == 0
    log.now()
    warm_up, first, second = seen
    assert "decode tok/s" in first and not _row_lines(first, "1")
    assert len(_row_lines(second, "1")) == 1 and not _row_lines(second, "2")
    assert len(_row_lines(log.out, "2")) == 1

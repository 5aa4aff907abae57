"""launch/gpu_check.sh, the one-call GPU check: its dry run (every stage's command on CPU, Triton
interpreted, tiny sizes) passes, a failing or hung stage does not stop the next, the greedy
comparison tells near-ties from wrong tokens, and the CPU reference it ships still holds."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tandem.launch.gpu_check_stages import PROMPTS, compare, dump_reference, model_identity

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "gpu_check.sh"
REFERENCE = ROOT / "launch" / "gpu_check_reference.json"
STAGES = ("install", "env", "kernel-tests", "greedy", "determinism", "bench-kernels", "one-batch", "offline")


def _run(out: Path, *args: str, **env: str) -> tuple[int, str]:
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "GPU_CHECK_PYTHON": sys.executable, "OUT": str(out), **env})
    return proc.returncode, proc.stdout + proc.stderr


def _status(output: str, stage: str) -> str | None:
    match = re.search(rf"^gpu_check: {re.escape(stage)} +(\w+) ", output, re.M)
    return match.group(1) if match else None


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


@pytest.mark.timeout(420)
def test_the_dry_run_passes_every_stage(tmp_path: Path) -> None:
    rc, output = _run(tmp_path, "--dry-run")
    assert rc == 0, output
    for stage in STAGES:
        assert _status(output, stage) == "PASS", f"{stage}:\n{output}"
    assert "gpu_check: could not: nothing" in output
    # the results come back through $OUT: the summary lines and every stage's log
    summary = (tmp_path / "gpu_check_summary.txt").read_text()
    assert all(_status(summary, stage) == "PASS" for stage in STAGES)
    with tarfile.open(tmp_path / "gpu_check_logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{stage}.log" for stage in STAGES} <= names
    assert {"json/greedy.json", "json/determinism.json", "json/one_batch.jsonl", "json/offline.json"} <= names
    # the stage lines carry the numbers, not just a verdict
    assert re.search(r"greedy .* 3/3 prompts match the reference exactly", output)
    assert re.search(r"determinism .* alone vs cached 3/3 .* 3/3", output)


@pytest.mark.timeout(300)
def test_a_hung_or_unknown_stage_does_not_stop_the_next(tmp_path: Path) -> None:
    rc, output = _run(tmp_path, "--dry-run", "--stages", "greedy,nosuch,bench-kernels",
                      GPU_CHECK_TIMEOUTS="greedy=4")
    assert rc == 1
    assert _status(output, "greedy") == "TIMEOUT" and _status(output, "nosuch") == "FAIL"
    assert _status(output, "bench-kernels") == "PASS"
    assert "could not: greedy (TIMEOUT); nosuch (FAIL)" in output
    work = re.search(r"work in (\S+),", output).group(1)
    assert not Path(work).exists()
    assert not _processes_mentioning(work), "a stage's server outlived its timeout"


def test_compare_tells_near_ties_from_wrong_tokens() -> None:
    ref = [{"output_ids": [5, 6, 7, 8], "logprobs": [-0.1, -0.2, -0.3, -0.4], "gaps": [3.0, 0.001, 2.0, 2.0]},
           {"output_ids": [1, 2, 3], "logprobs": [-0.5, -0.5, -0.5], "gaps": [1.0, 1.0, 1.0]}]
    same = compare(ref, [dict(r) for r in ref])
    assert same.ok and same.exact == 2 and same.max_logprob_diff == 0.0
    # token 1 of prompt 0 was a near-tie on the reference: another arithmetic may pick the other
    tie = compare(ref, [{"output_ids": [5, 9, 9, 9], "logprobs": [-0.1, -0.2, -1, -1]}, ref[1]])
    assert tie.ok and tie.exact == 1 and tie.near_ties == [(0, 1, 0.001)]
    wrong = compare(ref, [ref[0], {"output_ids": [1, 4, 3], "logprobs": [-0.5, -0.5, -0.5]}])
    assert not wrong.ok and "prompt 1: diverges at token 1" in wrong.failures[0]
    drift = compare(ref, [ref[0], {"output_ids": [1, 2, 3], "logprobs": [-0.5, -0.7, -0.5]}])
    assert not drift.ok and drift.max_logprob_diff == pytest.approx(0.2)
    short = compare(ref, [ref[0], {"output_ids": [1, 2], "logprobs": [-0.5, -0.5]}])
    assert not short.ok  # an answer that stops early is no near-tie
    assert not compare(ref, ref[:1]).ok


def test_the_shipped_reference_is_the_default_model_on_every_prompt() -> None:
    ref = json.loads(REFERENCE.read_text())
    assert [r["text"] for r in ref["rows"]] == list(PROMPTS)
    assert ref["dtype"] == "float32" and ref["max_new_tokens"] == 32
    for r in ref["rows"]:
        assert 0 < len(r["output_ids"]) <= 32 and len(r["output_ids"]) == len(r["logprobs"]) == len(r["gaps"])
        assert all(g >= 0 for g in r["gaps"])
    assert json.loads(dump_reference(ref)) == ref
    from tandem.runtime.model_files import default_model_path

    assert model_identity(default_model_path()) == ref["model"]


@pytest.mark.timeout(300)
def test_the_shipped_reference_still_holds_on_cpu() -> None:
    """The greedy stage against it on this CPU: a stale reference would fail every GPU run.
    (A subprocess: the stage installs its own SIGTERM handler.) Another CPU may part at a near-tie."""
    proc = subprocess.run([sys.executable, "-m", "tandem.launch.gpu_check_stages", "greedy", "--reference",
                           str(REFERENCE), "--server-args", "--device cpu"], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^summary: \d/8 prompts match the reference exactly", proc.stdout, re.M), proc.stdout

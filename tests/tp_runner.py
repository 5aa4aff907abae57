"""Run a model at tensor parallel size N as N gloo ranks (child processes) of one BareLoop
generation, for the TP tests: rank 0's greedy ids and per-step logits come back."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import torch

PROMPTS = [list(range(300, 340)), list(range(500, 507)), [42]]

RANK_SCRIPT = textwrap.dedent("""
    import sys, torch
    from tandem.launch.bare_loop import BareLoop
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.model.tensor_parallel import init_tensor_parallel
    from tandem.runtime.server_args import ServerArgs
    path, addr, rank, size, out = sys.argv[1] or None, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    tp, _ = init_tensor_parallel(rank, size, addr, torch.device("cpu"))
    args = ServerArgs(model_path=path, max_total_tokens=600, max_running_requests=4, dtype="float32", tp_size=size)
    res = BareLoop(ModelRunner(args, tp)).generate({prompts}, 10, keep_logits=True)
    if rank == 0:
        torch.save({{"ids": res.output_ids, "logits": res.step_logits}}, out)
    # leave together: a rank that exits while its peer's gloo pair threads still talk to it can
    # take the peer down at exit ("terminate called without an active exception", seen once in CI)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
""")


def free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_tp(path: str | None, size: int, out: str, prompts: list[list[int]] = PROMPTS) -> dict:
    """Rank 0's greedy ids ("ids") and per-step logits ("logits") for 10 new tokens of each prompt."""
    addr = free_addr()
    script = RANK_SCRIPT.format(prompts=prompts)
    procs = [subprocess.Popen([sys.executable, "-c", script, path or "", addr, str(rank), str(size), out],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(size)]
    deadline = time.monotonic() + 240  # one deadline for all ranks, not 240 s each in turn
    logs = []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0])  # what the rank printed before it hung
                raise AssertionError("a rank did not finish within 240 s:\n" + "\n".join(logs)[-3000:]) from None
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-3000:]
    return torch.load(out)


def assert_tp2_equals_tp1(path: str, out: str) -> None:
    """Greedy ids equal and per-step fp32 logits within 1e-4 (the all-reduce only reorders sums)."""
    from tandem.launch.bare_loop import BareLoop
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.server_args import ServerArgs

    ref = BareLoop(ModelRunner(ServerArgs(model_path=path, max_total_tokens=600, max_running_requests=4,
                                          dtype="float32"))).generate(PROMPTS, 10, keep_logits=True)
    got = run_tp(path, 2, out)
    assert got["ids"] == ref.output_ids
    for a, b in zip(ref.step_logits, got["logits"]):
        assert (a - b).abs().max().item() < 1e-4

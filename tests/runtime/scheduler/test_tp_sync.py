"""ControlSync on two gloo ranks (child processes): the ranks refuse to start when their nodes
were launched with different planning settings, naming the flag, instead of planning different
batches and pairing collectives of different sizes."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

RANK_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from tandem.runtime.model.tensor_parallel import init_tensor_parallel
    from tandem.runtime.scheduler.tp_sync import ControlSync, lockstep_settings
    from tandem.runtime.server_args import ServerArgs
    addr, rank, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    _, control = init_tensor_parallel(rank, 2, addr, torch.device("cpu"))
    sync = ControlSync(rank, control)
    try:
        kv = 4096 if seed >= 0 else 2048  # a negative "seed" stands for another --max-total-tokens
        rank0 = sync.agree(lockstep_settings(ServerArgs(tp_size=2, random_seed=abs(seed), node_rank=rank, nnodes=2,
                                                        dist_init_addr=addr, port=30000 + rank, max_total_tokens=kv)))
        shared = sync.share([], ["r1"], (["g1"], ["g2"])) if rank == 0 else sync.share([], [], ([], []))
        print("agreed", rank0["random_seed"], shared[1:], flush=True)
        # leave together: a rank that exits while its peer's gloo pair threads still talk to it
        # can take the peer down at exit ("terminate called without an active exception")
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except ValueError as exc:
        print("refused:", exc, flush=True)
    # and skip C++ static destruction: gloo's threads can still be joinable there, and a rank that
    # had printed its answer died in it anyway ("terminate called ...", seen on CI after the barrier)
    os._exit(0)
""")


def run_ranks(seeds: tuple[int, int]) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, addr, str(rank), str(seed)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank, seed in enumerate(seeds)]
    try:
        return [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.timeout(200)
def test_nodes_with_another_planning_flag_refuse_to_start_naming_it():
    rank0, rank1 = run_ranks((7, -7))
    assert "refused: TP rank 1: --max-total-tokens is 2048 here but 4096 on rank 0" in rank1, rank1
    assert "refused: TP rank 0: another node was started with other flags than rank 0's" in rank0, rank0


@pytest.mark.timeout(200)
def test_nodes_take_rank0s_seed_as_sglang_broadcasts_it():
    """Node 0 launched with --random-seed 42, node 1 without it (0 there): both sample with 42."""
    assert [out.strip().splitlines()[-1] for out in run_ranks((42, 0))] == ["agreed 42 (['r1'], (['g1'], ['g2']))"] * 2


@pytest.mark.timeout(200)
def test_nodes_with_the_same_settings_agree_and_share_rank0s_inputs():
    # --port and --node-rank differ between the nodes, as they may: only node 0 serves
    assert [out.strip().splitlines()[-1] for out in run_ranks((7, 7))] == ["agreed 7 (['r1'], (['g1'], ['g2']))"] * 2

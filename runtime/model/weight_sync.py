"""A process group between a trainer and the server's ranks, outside the server's own TP group.

The trainer is rank 0 and hosts the group's TCP store at master_address:master_port; TP rank r
of the server is rank `rank_offset + r`. The trainer broadcasts each tensor from rank 0, in the
order of the update's `names`. Trainers join with the same function:

    group = init_weights_group("127.0.0.1", port, rank=0, world_size=1 + tp_size, group_name="g")
    broadcast(group, tensor)  # once per tensor of an update_weights_from_distributed call
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.ipc.messages import WEIGHT_DTYPES


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" -> torch.bfloat16 (SGLang's bodies carry either)."""
    name = name.removeprefix("torch.")
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"{name!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    return getattr(torch, name)


@dataclass(frozen=True)
class WeightsGroup:
    group: dist.ProcessGroup
    store: dist.Store  # must outlive the group: rank 0 serves it


def init_weights_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                       backend: str = "gloo", timeout_s: float = 300.0) -> WeightsGroup:
    """Join (rank 0: host) the group; returns when every rank has joined."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "nccl":
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
    elif backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        raise ValueError(f"backend {backend!r} is not gloo or nccl")
    barrier = torch.zeros(1, device="cuda" if backend == "nccl" else "cpu")
    group.allreduce([barrier]).wait()  # every rank is there before the first broadcast
    return WeightsGroup(group, store)


def broadcast(group: WeightsGroup, tensor: torch.Tensor) -> None:
    """From rank 0 to every rank, in place."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.group.broadcast([tensor], opts).wait()

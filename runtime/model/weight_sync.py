"""A process group between a trainer and the server's ranks, outside the server's own TP group.

The trainer is rank 0 and hosts the group's TCP store at master_address:master_port; TP rank r
of the server is rank `rank_offset + r`. The trainer broadcasts each tensor from rank 0, in the
order of the update's `names`. Trainers join with the same function:

    group = init_weights_group("127.0.0.1", port, rank=0, world_size=1 + tp_size, group_name="g")
    broadcast(group, tensor)  # once per tensor of an update_weights_from_distributed call
    broadcast(group, flatten(tensors))  # or once per call, with load_format="flattened_bucket"

SGLang's two wire formats: one broadcast per tensor, or (load_format "flattened_bucket", its
FlattenedTensorBucket) one broadcast of every tensor flattened and concatenated in order, in the
dtype torch.cat promotes them to. Few large broadcasts move bytes several times faster over gloo
than many small ones.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import reduce

import torch
import torch.distributed as dist

from tandem.ipc.messages import WEIGHT_DTYPES


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" -> torch.bfloat16 (SGLang's bodies carry either)."""
    name = name.removeprefix("torch.")
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"{name!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    return getattr(torch, name)


@dataclass
class WeightsGroup:
    """`arena`: a receiving rank's buffer for the tensors of an update, kept from one update to
    the next (fresh memory costs the kernel's page faults and zeroing, more than the copy into it)
    and grown to the largest update; `drop_arena` gives it back."""
    group: dist.ProcessGroup
    store: dist.Store  # must outlive the group: rank 0 serves it
    arena: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """`nbytes` bytes of the arena (uint8), valid until the next call."""
        if self.arena is None or self.arena.numel() < nbytes or self.arena.device != device:
            self.arena = None
            self.arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.arena[:nbytes]

    def drop_arena(self) -> None:
        self.arena = None


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


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The trainer's one buffer for load_format "flattened_bucket" (SGLang's FlattenedTensorBucket)."""
    return torch.cat([t.flatten() for t in tensors])


def receive(group: WeightsGroup, specs: Sequence[tuple[torch.dtype, Sequence[int]]], device: torch.device,
            flattened: bool = False) -> list[torch.Tensor]:
    """The tensors the trainer broadcasts, one per (dtype, shape) spec, in order, as views of the
    group's arena (valid until its next update), once every one has arrived: a caller writes none
    before the transfer is whole. Per tensor, every broadcast is posted at once; `flattened`, one
    buffer holds them all. A failed transfer raises (the rest fail alike, or at the group's timeout)."""
    if flattened:
        return _unflatten(group, specs, device)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    posted = [(tensor, group.group.broadcast([tensor], opts)) for tensor in _carve(group, specs, device)]
    for _, work in posted:
        work.wait()
    return [tensor for tensor, _ in posted]


_ALIGN = 64  # bytes: each tensor of the arena starts on a cache line


def _carve(group: WeightsGroup, specs: Sequence[tuple[torch.dtype, Sequence[int]]],
           device: torch.device) -> list[torch.Tensor]:
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in specs]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // _ALIGN) * _ALIGN)
    arena = group.take(starts[-1], device)
    return [arena[start:start + size].view(dtype).view(shape)
            for (dtype, shape), start, size in zip(specs, starts, sizes)]


def _unflatten(group: WeightsGroup, specs: Sequence[tuple[torch.dtype, Sequence[int]]],
               device: torch.device) -> list[torch.Tensor]:
    dtype = reduce(torch.promote_types, (d for d, _ in specs))
    sizes = [math.prod(shape) for _, shape in specs]
    flat = group.take(sum(sizes) * dtype.itemsize, device).view(dtype)
    broadcast(group, flat)
    return [part.view(shape).to(dtype) for (dtype, shape), part in zip(specs, flat.split(sizes))]

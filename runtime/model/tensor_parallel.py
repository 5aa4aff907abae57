"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA), Megatron-style.

Invariant: every rank holds 1/size of each attention layer's query and KV heads, of each MLP's
intermediate width and of the vocabulary; the hidden state between layers is whole and identical
on every rank. So qkv_proj and gate_up_proj are column-parallel (rows of the fused weight split by
head / by half), o_proj and down_proj are row-parallel and followed by an all-reduce, the
embedding is vocab-parallel (each rank looks up its own ids, an all-reduce fills the rest) and
the LM head's logits are all-gathered, so every rank samples the same token from the same logits
with the same seed and tokens never travel between ranks. Mixture-of-experts layers split every
expert by its intermediate width the same way (runtime/model/moe.py); the router is replicated.

Heads are never split unevenly or replicated: a size that does not divide the query heads, the
KV heads, the intermediate size and the vocabulary is refused, naming the counts.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.runtime.model.config import ModelConfig

logger = logging.getLogger(__name__)


class TensorParallel:
    """This rank's place in the job, and the host time its model collectives took (`comm_s`:
    the whole exchange with gloo, only the launch with NCCL, which runs asynchronously)."""

    def __init__(self, rank: int = 0, size: int = 1, group: object | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.comm_s = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            t0 = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            self.comm_s += time.perf_counter() - t0
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.comm_s += time.perf_counter() - t0
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


def check_divisible(cfg: ModelConfig, size: int) -> None:
    counts = {"query heads": cfg.num_heads, "KV heads": cfg.num_kv_heads,
              "intermediate size": cfg.intermediate_size, "vocabulary": cfg.vocab_size}
    if cfg.num_experts:
        counts["expert intermediate size"] = cfg.moe_intermediate_size
    bad = {name: n for name, n in counts.items() if n % size}
    if bad:
        have = ", ".join(f"{n} {name}" for name, n in counts.items())
        raise ValueError(f"--tp-size {size} does not divide the model's {' and '.join(bad)} (it has {have}); "
                         f"tensor parallelism splits each evenly across ranks, without replication")


def shard_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slices of the fused checkpoint (runtime/model/loader.py names)."""
    if tp.size == 1:
        return weights
    r, n = tp.rank, tp.size
    d = cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d

    def part(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return t.chunk(n, dim=dim)[r].contiguous()

    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: each expert's gate and up rows split
            gate, up = t.chunk(2, dim=1)
            out[name] = torch.cat([part(gate, 1), part(up, 1)], dim=1)
        elif name.endswith(".experts.down_proj"):  # [E, H, I]: each expert's input columns split
            out[name] = part(t, 2)
        elif ".qkv_proj." in name:  # [q; k; v] rows: each split by heads
            q, k, v = t.split([q_rows, kv_rows, kv_rows], dim=0)
            out[name] = torch.cat([part(q), part(k), part(v)], dim=0)
        elif ".gate_up_proj." in name:  # [gate; up] rows: each split
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([part(gate), part(up)], dim=0)
        elif ".o_proj." in name or ".down_proj." in name:  # row-parallel: split the input columns
            out[name] = part(t, dim=1)
        elif name in ("embed_tokens.weight", "lm_head.weight"):  # vocab rows
            out[name] = part(t)
        else:  # norms: replicated
            out[name] = t
    return out


def init_tensor_parallel(rank: int, size: int, init_addr: str, device: torch.device,
                         timeout_s: int | None = None) -> tuple[TensorParallel, object]:
    """Join the job: returns the model's group and a second group for the scheduler's control
    messages (the scheduler thread and the forward thread must never interleave collectives on
    one group, or ranks could pair different calls)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the join blocks until every rank of every node arrives (--dist-timeout, or torch's 30 minutes), and a
    # node never started is otherwise a silent wait: say what is awaited, and when it is over
    logger.info("TP rank %d: waiting at %s for all %d ranks to join (%s)", rank, init_addr, size, backend)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)  # --dist-timeout, as SGLang's
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    logger.info("TP rank %d: all %d ranks joined", rank, size)
    return TensorParallel(rank, size, dist.group.WORLD), control


class VocabParallelEmbedding(torch.nn.Module):
    """Rows [rank * V/size, (rank + 1) * V/size) of the embedding; ids elsewhere look up zeros here."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.local_vocab = vocab_size // tp.size
        self.start = tp.rank * self.local_vocab
        self.weight = torch.nn.Parameter(torch.empty(self.local_vocab, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        x = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

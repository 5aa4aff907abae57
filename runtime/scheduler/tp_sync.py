"""Lockstep scheduling under tensor parallelism: rank 0 shares each iteration's inputs.

Invariant: every rank's scheduler sees the same inputs in the same order (the messages rank 0
received from the tokenizer manager this iteration, the waiting requests rank 0's clock timed
out, and the constrained requests whose grammar rank 0 saw compile or time out), and planning is
a deterministic function of them, so every rank plans the same batches without sending batches,
and samples the same tokens (same logits, same seeds) without sending tokens. Rank 0 broadcasts
the byte count and then the bytes, every iteration, on the control group (gloo), which only the
scheduler thread uses.
"""
from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from tandem.ipc.codec import decode, encode
from tandem.ipc.messages import Message
from tandem.runtime.server_args import ServerArgs

# the settings the planner and the sampler read: ranks that differ in one of them plan different
# batches or sample different tokens, and their collectives then pair calls of different sizes,
# which gloo does not notice (wrong tokens, then a hang), so they must agree before the first step
LOCKSTEP_FIELDS = ("dtype", "kv_cache_dtype", "max_total_tokens", "max_running_requests",
                   "max_queued_requests", "max_prefill_tokens", "chunked_prefill_size", "context_length",
                   "schedule_policy", "enable_priority_scheduling", "disable_priority_preemption",
                   "schedule_low_priority_values_first", "priority_scheduling_preemption_threshold",
                   "abort_on_priority_when_disabled", "disable_radix_cache", "disable_overlap_schedule",
                   "grammar_backend", "constrained_json_disable_any_whitespace")


# taken from rank 0 instead of compared: SGLang's scheduler broadcasts rank 0's seed, so nodes
# launched with another --random-seed, or without one (0 there), sample with the head node's
ADOPTED_FIELDS = ("random_seed",)


def lockstep_settings(args: ServerArgs) -> dict[str, object]:
    return {name: getattr(args, name) for name in LOCKSTEP_FIELDS + ADOPTED_FIELDS}


class IterationInputs(msgspec.Struct, frozen=True):
    messages: list[bytes]  # each encoded with the IPC codec
    expired_rids: list[str]
    grammar_done: list[str]  # compiled (or failed to) on rank 0: every rank takes them out now
    grammar_expired: list[str]  # past --grammar-compile-timeout on rank 0's clock


class ControlSync:
    def __init__(self, rank: int, group: object) -> None:
        self.rank, self.group = rank, group
        # the envelope of one iteration's already-encoded messages: its own small codec, since it
        # travels over the gloo group and not over the IPC sockets ipc.codec serves
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(IterationInputs)

    def agree(self, settings: dict[str, object]) -> dict[str, object]:
        """Every rank: rank 0's settings; raise (naming the flags on the rank that differs) unless all
        ranks have rank 0's LOCKSTEP_FIELDS. Each node is launched on its own (--nnodes), so nothing
        else makes them agree."""
        theirs = msgspec.json.decode(self._broadcast(msgspec.json.encode(settings) if self.rank == 0 else None))
        differ = [f"--{name.replace('_', '-')} is {settings.get(name)!r} here but {value!r} on rank 0"
                  for name, value in theirs.items() if name not in ADOPTED_FIELDS and settings.get(name) != value]
        flag = torch.tensor([int(bool(differ))], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # so that every rank stops, not one
        if differ:
            raise ValueError(f"TP rank {self.rank}: {'; '.join(differ)}: every node must be started with the same "
                             f"flags (all but --node-rank)")
        if flag.item():
            raise ValueError(f"TP rank {self.rank}: another node was started with other flags than rank 0's "
                             f"(its log names them)")
        return theirs

    def _broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0's bytes to every rank: the length, then the bytes."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
               else torch.empty(int(size.item()), dtype=torch.uint8))
        dist.broadcast(buf, src=0, group=self.group)
        return payload if payload is not None else buf.numpy().tobytes()

    def share(self, messages: list[Message], expired_rids: list[str], grammar_settled: tuple[list[str], list[str]]
              ) -> tuple[list[Message], list[str], tuple[list[str], list[str]]]:
        """Rank 0: send its inputs and return them. Other ranks: pass nothing, get rank 0's."""
        if self.rank == 0:
            self._broadcast(self._encoder.encode(IterationInputs([encode(m) for m in messages], expired_rids,
                                                                 *grammar_settled)))
            return messages, expired_rids, grammar_settled
        inputs = self._decoder.decode(self._broadcast(None))
        return ([decode(m) for m in inputs.messages], inputs.expired_rids,
                (inputs.grammar_done, inputs.grammar_expired))

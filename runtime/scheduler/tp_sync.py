"""Lockstep scheduling under tensor parallelism: rank 0 shares each iteration's inputs.

Invariant: every rank's scheduler sees the same inputs in the same order (the messages rank 0
received from the tokenizer manager this iteration, and the waiting requests rank 0's clock
timed out), and planning is a deterministic function of them, so every rank plans the same
batches without sending batches, and samples the same tokens (same logits, same seeds) without
sending tokens. Rank 0 broadcasts the byte count and then the bytes, every iteration, on the
control group (gloo), which only the scheduler thread uses.
"""
from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from tandem.ipc.codec import decode, encode
from tandem.ipc.messages import Message


class IterationInputs(msgspec.Struct, frozen=True):
    messages: list[bytes]  # each encoded with the IPC codec
    expired_rids: list[str]


class ControlSync:
    def __init__(self, rank: int, group: object) -> None:
        self.rank, self.group = rank, group
        # the envelope of one iteration's already-encoded messages: its own small codec, since it
        # travels over the gloo group and not over the IPC sockets ipc.codec serves
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(IterationInputs)

    def share(self, messages: list[Message], expired_rids: list[str]) -> tuple[list[Message], list[str]]:
        """Rank 0: send its inputs and return them. Other ranks: pass nothing, get rank 0's."""
        if self.rank == 0:
            payload = self._encoder.encode(IterationInputs([encode(m) for m in messages], expired_rids))
            size = torch.tensor([len(payload)], dtype=torch.int64)
            dist.broadcast(size, src=0, group=self.group)
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)
            return messages, expired_rids
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        inputs = self._decoder.decode(buf.numpy().tobytes())
        return [decode(m) for m in inputs.messages], inputs.expired_rids

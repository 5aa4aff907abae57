"""The bare model loop: prefill a batch and decode it with no scheduler, IPC or detokenizer.

Used by `tandem generate`, `tandem bench one-batch`, the offline benchmark's upper bound, and
tests that compare tandem's model against transformers.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from tandem.runtime.cache.pools import decode_run
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.sampling.sampler import SamplingBatchInfo


@dataclass
class LoopSampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None


@dataclass
class LoopResult:
    output_ids: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_logits: list[torch.Tensor] = field(default_factory=list)  # [B, V] float32 per sampled position, if kept


class BareLoop:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._reserved_to: dict[int, int] = {}  # row -> end of the decode slots it holds ahead

    def prefill(self, prompts: list[list[int]], rows: list[int], prefix_lens: list[int] | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Extend each row by its prompt (after `prefix_lens` tokens already in the row); logits in the model dtype."""
        r = self.runner
        prefix_lens = prefix_lens or [0] * len(prompts)
        new_ids = [p[pre:] for p, pre in zip(prompts, prefix_lens)]
        ext_lens = [len(x) for x in new_ids]
        slots = r.allocator.alloc(sum(ext_lens))
        if slots is None:
            raise RuntimeError("out of KV slots")
        offset = 0
        for row, pre, n in zip(rows, prefix_lens, ext_lens):
            r.req_to_token_pool.req_to_token[row, pre:pre + n] = slots[offset:offset + n]
            offset += n
        logits_idx = list(range(sum(ext_lens))) if all_logits else None
        batch = ForwardBatch.build(ForwardMode.EXTEND, [t for x in new_ids for t in x], rows, prefix_lens,
                                   ext_lens, slots, logits_idx, r.device)
        return r.forward(batch)

    def decode(self, last_ids: torch.Tensor, rows: list[int], seq_lens: list[int],
               last_positions: list[int]) -> torch.Tensor:
        """One token per row at position seq_lens[i]; returns logits [B, V] (model dtype). Slots
        come a run at a time, as the scheduler takes them, never past last_positions[i]."""
        r = self.runner
        req_to_token = r.req_to_token_pool.req_to_token
        for row, pos, last in zip(rows, seq_lens, last_positions):
            if self._reserved_to.get(row, 0) <= pos:
                n = decode_run(pos, last)
                run = r.allocator.alloc(n)
                if run is None:
                    raise RuntimeError("out of KV slots")
                req_to_token[row, pos:pos + n] = run
                self._reserved_to[row] = pos + n
        slots = req_to_token[torch.tensor(rows), torch.tensor(seq_lens)]
        batch = ForwardBatch.build(ForwardMode.DECODE, last_ids, rows, seq_lens, [1] * len(rows), slots,
                                   None, r.device)
        return r.forward(batch)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: LoopSampling | list[LoopSampling] | None = None,
                 keep_logits: bool = False) -> LoopResult:
        r = self.runner
        n = len(prompts)
        params = sampling if isinstance(sampling, list) else [sampling or LoopSampling()] * n
        info = SamplingBatchInfo.build([p.temperature for p in params], [p.top_p for p in params],
                                       [p.top_k for p in params], [p.min_p for p in params],
                                       [p.seed if p.seed is not None else random.getrandbits(32) for p in params],
                                       r.config.vocab_size, r.device)
        rows = [r.req_to_token_pool.alloc() for _ in range(n)]
        if any(row is None for row in rows):
            raise RuntimeError("out of request rows")
        seq_lens = [len(p) for p in prompts]
        last_positions = [length + max_new_tokens - 2 for length in seq_lens]  # the last sampled token is never input
        out: list[list[int]] = [[] for _ in range(n)]
        result = LoopResult(out)
        try:
            t0 = time.perf_counter()
            logits = self.prefill(prompts, rows)
            for step in range(max_new_tokens):
                if keep_logits:
                    result.step_logits.append(logits.float())
                ids = r.sample(logits, info, torch.tensor(seq_lens, device=r.device))
                for i, t in enumerate(ids.tolist()):
                    out[i].append(t)
                if step == 0:
                    result.prefill_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                if step == max_new_tokens - 1:
                    break
                logits = self.decode(ids, rows, seq_lens, last_positions)
                seq_lens = [s + 1 for s in seq_lens]
            result.decode_s = time.perf_counter() - t0
        finally:
            self.release(rows, seq_lens)
        return result

    def release(self, rows: list[int], seq_lens: list[int]) -> None:
        r = self.runner
        for row, length in zip(rows, seq_lens):
            held = max(length, self._reserved_to.pop(row, 0))
            r.allocator.free(r.req_to_token_pool.req_to_token[row, :held].clone())
            r.req_to_token_pool.free(row)

"""What one forward pass runs on: extend (prefill after an optional cached prefix) or decode."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class ForwardMode(Enum):
    EXTEND = "extend"
    DECODE = "decode"
    # speculative decode step: the last token plus drafts per request, at positions only the
    # worker knows (the step before decides them); it runs as an extend (or a decode, draftless)
    TARGET_VERIFY = "target_verify"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of ReqToTokenPool
    seq_lens: torch.Tensor  # [bs] int64, length after this pass
    out_cache_loc: torch.Tensor  # [num_tokens] int64, slots the new K/V go to
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]  # cached tokens before this pass
    extend_lens_cpu: list[int]  # new tokens in this pass (1 each for decode)
    logits_indices: torch.Tensor  # [num_logits] positions into the token dim whose logits are needed
    attn_metadata: object | None = field(default=None, repr=False)  # set by the attention backend

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @staticmethod
    def build(mode: ForwardMode, input_ids: list[int] | torch.Tensor, req_pool_indices: list[int],
              prefix_lens: list[int], extend_lens: list[int], out_cache_loc: torch.Tensor,
              logits_indices: list[int] | None = None, device: torch.device | str = "cpu") -> "ForwardBatch":
        """Derive positions, seq lens and (by default) last-token logits indices from per-request lengths."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        positions = torch.cat([torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)])
        if logits_indices is None:
            ends = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0)
            logits_idx = ends - 1
        else:
            logits_idx = torch.tensor(logits_indices, dtype=torch.int64)
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids, dtype=torch.int64)
        return ForwardBatch(
            mode=mode,
            input_ids=ids.to(device),
            positions=positions.to(device),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64).to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),
            out_cache_loc=out_cache_loc.to(device),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
            logits_indices=logits_idx.to(device),
        )

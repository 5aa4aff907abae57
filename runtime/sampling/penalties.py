"""Batched logit penalties, logit bias and min-new-tokens bans (device side, torch).

Order inside `apply_penalties`, SGLang's (additive penalties first, then the scaling one):
  1. frequency: `logit -= frequency * count`; presence: `logit -= presence * (count > 0)`
     (OpenAI semantics);
  2. repetition (HF/SGLang style, multiplicative): for tokens already in the row's output,
     positive logits are divided by p and negative ones multiplied by p (p > 1 discourages),
     applied to the logits the additive penalties left, so a request that sets both samples
     what it would on SGLang;
  3. logit bias is added last among the finite terms, so a bias is never scaled by repetition;
  4. rows still under `min_new_tokens` get -inf on their banned ids (EOS + stop_token_ids; the
     caller's [B, V] `ban_mask`, made when the batch forms, not every step),
     except a grammar-masked row the bans would leave with nothing to sample: its grammar has
     ended and allows only its end, and min_new_tokens cannot outlast the constraint.

Like SGLang, penalties count only *output* tokens (the prompt is not penalized): a penalty
that also hit the prompt would punish the model for echoing names and code from its input.

Rows with default settings (frequency = presence = 0, repetition = 1, no bias, no ban) come
out unchanged, so one dense pass over the batch is correct for mixed batches; callers skip
the call entirely when no row of the batch uses any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


__all__ = ["PenaltyCounts", "apply_penalties"]


def apply_penalties(
    logits: Tensor,
    output_token_counts: Tensor | None,
    frequency: Tensor | None,
    presence: Tensor | None,
    repetition: Tensor | None,
    *,
    logit_bias: Tensor | None = None,
    ban_mask: Tensor | None = None,
    grammar_masked: bool = False,
) -> Tensor:
    """Return penalized logits [B, V] (a new tensor; the input is not modified).

    `output_token_counts` [B, V] counts each token in each row's output so far. `ban_mask` [B, V]
    is True where a row may not sample the id (min_new_tokens).
    `grammar_masked`: `logits` carry a grammar mask (-inf), so a ban may empty a row.
    """
    out = logits.clone()
    if output_token_counts is not None:
        counts = output_token_counts.to(out.dtype)
        seen = counts > 0
        if frequency is not None:
            out = out - frequency.to(out.dtype).unsqueeze(1) * counts
        if presence is not None:
            out = out - presence.to(out.dtype).unsqueeze(1) * seen.to(out.dtype)
        if repetition is not None:
            p = repetition.to(out.dtype).unsqueeze(1).expand_as(out)
            penalized = torch.where(out > 0, out / p, out * p)
            out = torch.where(seen, penalized, out)
    if logit_bias is not None:
        out = out + logit_bias.to(out.dtype)
    if ban_mask is not None:
        banned = out.masked_fill(ban_mask, float("-inf"))
        if grammar_masked:
            out = torch.where(torch.isneginf(banned).all(dim=1, keepdim=True), out, banned)
        else:
            out = banned
    return out


class PenaltyCounts:
    """Output-token counts per request row, [rows, vocab] int32 on the device, made on first use.

    A row's counts are reset when the row is handed to a request (`reset_row`, from the
    scheduler thread, by the row owner) and grow after every sampling step (`add`, from the
    forward worker). Both touch disjoint rows: a row is handed out again only after every step
    that used it was processed. Rows of requests without count-based penalties are never read.
    """

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = device
        self.counts: Tensor | None = None

    def reset_row(self, row: int, output_ids: Sequence[int]) -> None:
        if self.counts is None:
            self.counts = torch.zeros((self.num_rows, self.vocab_size), dtype=torch.int32, device=self.device)
        self.counts[row].zero_()
        if output_ids:
            ids = torch.tensor(list(output_ids), dtype=torch.int64, device=self.counts.device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def gather(self, rows: Tensor) -> Tensor:
        assert self.counts is not None, "penalty counts read before any row was reset"
        return self.counts[rows]

    def add(self, rows: Tensor, token_ids: Tensor) -> None:
        if self.counts is not None:
            self.counts[rows, token_ids] += 1

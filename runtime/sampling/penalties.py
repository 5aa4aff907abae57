"""Batched logit penalties, logit bias and min-new-tokens bans (device side, torch).

Order inside `apply_penalties`, chosen so each knob means what its name says:
  1. repetition (HF/SGLang style, multiplicative): for tokens already in the row's output,
     positive logits are divided by p and negative ones multiplied by p (p > 1 discourages);
  2. frequency: `logit -= frequency * count`; presence: `logit -= presence * (count > 0)`
     (OpenAI semantics);
  3. logit bias is added last among the finite terms, so a bias is never scaled by repetition;
  4. rows still under `min_new_tokens` get -inf on their banned ids (EOS + stop_token_ids).

Like SGLang, penalties count only *output* tokens (the prompt is not penalized): a penalty
that also hit the prompt would punish the model for echoing names and code from its input.

Rows with default settings (frequency = presence = 0, repetition = 1, no bias, no ban) come
out unchanged, so one dense pass over the batch is correct for mixed batches; callers skip
the call entirely when `PenaltyState.active` is False.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.runtime.sampling.params import SamplingParams

__all__ = ["PenaltyState", "apply_penalties", "ban_index"]


def apply_penalties(
    logits: Tensor,
    output_token_counts: Tensor | None,
    frequency: Tensor | None,
    presence: Tensor | None,
    repetition: Tensor | None,
    *,
    logit_bias: Tensor | None = None,
    min_tokens_mask: Tensor | None = None,
    eos_ids: Sequence[int] = (),
    banned_ids: list[list[int]] | Tensor | None = None,
) -> Tensor:
    """Return penalized logits [B, V] (a new tensor; the input is not modified).

    `output_token_counts` [B, V] counts each token in each row's output so far. `banned_ids`
    is per row (list of lists, or a [B, K] tensor padded with -1 from `ban_index`); `eos_ids`
    are banned in every masked row. Bans apply only where `min_tokens_mask` is True.
    """
    out = logits.clone()
    if output_token_counts is not None:
        counts = output_token_counts.to(out.dtype)
        seen = counts > 0
        if repetition is not None:
            p = repetition.to(out.dtype).unsqueeze(1).expand_as(out)
            penalized = torch.where(out > 0, out / p, out * p)
            out = torch.where(seen, penalized, out)
        if frequency is not None:
            out = out - frequency.to(out.dtype).unsqueeze(1) * counts
        if presence is not None:
            out = out - presence.to(out.dtype).unsqueeze(1) * seen.to(out.dtype)
    if logit_bias is not None:
        out = out + logit_bias.to(out.dtype)
    if min_tokens_mask is not None:
        out = _ban(out, min_tokens_mask, eos_ids, banned_ids)
    return out


def ban_index(
    banned_ids: list[list[int]], eos_ids: Sequence[int] = (), device: torch.device | str = "cpu"
) -> Tensor:
    """Pack per-row banned ids (+ shared EOS ids) into a [B, K] int64 tensor padded with -1."""
    rows = [list(eos_ids) + list(r) for r in banned_ids]
    k = max((len(r) for r in rows), default=0)
    packed = torch.full((len(rows), max(k, 1)), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            packed[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return packed.to(device)


def _ban(
    logits: Tensor,
    rows: Tensor,
    eos_ids: Sequence[int],
    banned_ids: list[list[int]] | Tensor | None,
) -> Tensor:
    b, v = logits.shape
    if banned_ids is None:
        banned_ids = [[] for _ in range(b)]
    if isinstance(banned_ids, Tensor):
        idx = banned_ids.to(logits.device)
        if eos_ids:
            shared = torch.tensor(list(eos_ids), dtype=idx.dtype, device=idx.device)
            idx = torch.cat([idx, shared.expand(b, -1)], dim=1)
    else:
        idx = ban_index(banned_ids, eos_ids, logits.device)
    # Padding (-1) goes to an extra scratch column that is dropped afterwards.
    idx = torch.where(idx < 0, torch.full_like(idx, v), idx)
    mask = torch.zeros((b, v + 1), dtype=torch.bool, device=logits.device)
    mask.scatter_(1, idx, True)
    mask = mask[:, :v] & rows.to(logits.device).bool().unsqueeze(1)
    return logits.masked_fill(mask, float("-inf"))


class PenaltyState:
    """Per-batch penalty tensors the scheduler keeps next to a running batch.

    Counts live on the device and are updated from the sampled-token tensor with
    `scatter_add_`, so the overlap loop never has to copy tokens to the host. The [B, V]
    count matrix is only allocated when some row uses a count-based penalty; rows that do not
    use one are unaffected by their (zero) counts, which is what makes lazy allocation safe.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        vocab_size: int,
        *,
        eos_ids: Sequence[int] = (),
        output_ids: Sequence[Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        b = len(params)
        outs = output_ids if output_ids is not None else [()] * b
        f32 = dict(dtype=torch.float32, device=self.device)
        self.frequency = torch.tensor([p.frequency_penalty for p in params], **f32)
        self.presence = torch.tensor([p.presence_penalty for p in params], **f32)
        self.repetition = torch.tensor([p.repetition_penalty for p in params], **f32)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.min_new_tokens = torch.tensor([p.min_new_tokens for p in params], **i64)
        self.output_len = torch.tensor([len(o) for o in outs], **i64)
        self.banned = ban_index([list(p.stop_token_ids) for p in params], eos_ids, self.device)
        # Host-side flag: asking the device tensor would force a sync every step. It may stay
        # True after the rows that needed it leave, which only costs a no-op masking pass.
        self.has_min_tokens = any(p.min_new_tokens > 0 for p in params)
        self.counts: Tensor | None = None
        if any(p.has_penalties for p in params):
            self.counts = self._counts_from(outs)
        self.logit_bias = self._bias_from(params)

    @property
    def batch_size(self) -> int:
        return self.frequency.shape[0]

    @property
    def active(self) -> bool:
        """False when `apply` would be a no-op for every row (the common case)."""
        return self.counts is not None or self.logit_bias is not None or self.has_min_tokens

    def _counts_from(self, outs: Sequence[Sequence[int]]) -> Tensor:
        counts = torch.zeros((len(outs), self.vocab_size), dtype=torch.int32, device=self.device)
        for i, ids in enumerate(outs):
            if ids:
                t = torch.as_tensor(list(ids), dtype=torch.int64, device=self.device)
                counts[i].scatter_add_(0, t, torch.ones_like(t, dtype=torch.int32))
        return counts

    def _bias_from(self, params: Sequence[SamplingParams]) -> Tensor | None:
        if not any(p.logit_bias for p in params):
            return None
        bias = torch.zeros((len(params), self.vocab_size), dtype=torch.float32)
        for i, p in enumerate(params):
            for tid, value in (p.logit_bias or {}).items():
                bias[i, tid] = value
        return bias.to(self.device)

    def update(self, new_tokens: Tensor) -> None:
        """Count freshly sampled tokens: [B] (one per row) or [B, T] padded with -1."""
        tokens = new_tokens.to(self.device, torch.int64)
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(1)
        valid = tokens >= 0
        self.output_len += valid.sum(dim=1)
        if self.counts is not None:
            safe = torch.where(valid, tokens, torch.zeros_like(tokens))
            self.counts.scatter_add_(1, safe, valid.to(self.counts.dtype))

    def apply(self, logits: Tensor) -> Tensor:
        if not self.active:
            return logits
        return apply_penalties(
            logits,
            self.counts,
            self.frequency,
            self.presence,
            self.repetition,
            logit_bias=self.logit_bias,
            min_tokens_mask=self.output_len < self.min_new_tokens if self.has_min_tokens else None,
            banned_ids=self.banned,
        )

    def filter(self, keep: Sequence[int] | Tensor) -> None:
        """Keep only rows `keep` (in that order), e.g. after finished requests leave."""
        idx = torch.as_tensor(keep, dtype=torch.int64, device=self.device)
        for name in ("frequency", "presence", "repetition", "min_new_tokens", "output_len"):
            setattr(self, name, getattr(self, name)[idx])
        self.banned = self.banned[idx]
        self.counts = None if self.counts is None else self.counts[idx]
        self.logit_bias = None if self.logit_bias is None else self.logit_bias[idx]

    def merge(self, other: PenaltyState) -> None:
        """Append `other`'s rows after ours (e.g. a prefilled batch joining the decode batch)."""
        for name in ("frequency", "presence", "repetition", "min_new_tokens", "output_len"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.banned = _cat_padded(self.banned, other.banned)
        self.has_min_tokens = self.has_min_tokens or other.has_min_tokens
        b1, b2 = self.batch_size - other.batch_size, other.batch_size
        self.counts = _cat_optional(self.counts, other.counts, b1, b2, self.vocab_size, torch.int32)
        self.logit_bias = _cat_optional(
            self.logit_bias, other.logit_bias, b1, b2, self.vocab_size, torch.float32
        )


def _cat_padded(a: Tensor, b: Tensor) -> Tensor:
    k = max(a.shape[1], b.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, k - t.shape[1]), value=-1)  # noqa: E731
    return torch.cat([pad(a), pad(b)])


def _cat_optional(
    a: Tensor | None, b: Tensor | None, rows_a: int, rows_b: int, v: int, dtype: torch.dtype
) -> Tensor | None:
    """Concatenate two lazily allocated [B, V] tensors; a missing side is zeros (a no-op)."""
    if a is None and b is None:
        return None
    ref = a if a is not None else b
    a = a if a is not None else torch.zeros((rows_a, v), dtype=dtype, device=ref.device)
    b = b if b is not None else torch.zeros((rows_b, v), dtype=dtype, device=ref.device)
    return torch.cat([a, b])

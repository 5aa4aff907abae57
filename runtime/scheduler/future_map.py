"""FutureMap: device buffers, indexed by request pool row, that carry step N's tokens into step N+1.

After each forward the worker stashes a RelayPayload: the sampled "bonus" token per row for
plain decoding, or the next draft input (draft tokens + accept lengths) for speculative
decoding, or nothing when the step sampled nothing (a middle prefill chunk). Step N+1 gathers
its input tokens from here on the device when it launches, so the CPU never waits for step N.

Debug mode (TANDEM_DEBUG_FUTURE_MAP) fills the buffers with POISON, poisons a row when it is
freed, and consumes entries on read: every gather must follow a stash for the same row, and a
gather of a poisoned entry fails an on-device assertion (no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

POISON = -(1 << 40)  # never a token id; a gather that returns it read a row nobody wrote


@dataclass
class RelayPayload:
    rows: torch.Tensor  # [B] int64 pool rows the payload belongs to
    bonus_tokens: torch.Tensor  # [B] int64: each row's last sampled token, the next step's first input
    # speculative servers only: where that token sits, and the drafts to verify after it
    seq_lens: torch.Tensor | None = None  # [B] int64: committed KV length = the bonus token's position
    draft_tokens: torch.Tensor | None = None  # [B, K] int64: the next step's draft input (padded)
    draft_lens: torch.Tensor | None = None  # [B] int64: valid drafts per row (0..K)

    @property
    def is_speculative(self) -> bool:
        return self.draft_tokens is not None


class FutureMap:
    def __init__(self, num_rows: int, device: torch.device | str, max_draft_tokens: int = 1, debug: bool = False) -> None:
        self.debug = debug
        fill = POISON if debug else 0
        self.bonus = torch.full((num_rows,), fill, dtype=torch.int64, device=device)
        self.seq_lens = torch.full((num_rows,), fill, dtype=torch.int64, device=device)
        self.draft = torch.full((num_rows, max_draft_tokens), fill, dtype=torch.int64, device=device)
        self.draft_lens = torch.zeros((num_rows,), dtype=torch.int64, device=device)

    def stash(self, payload: RelayPayload | None) -> None:
        if payload is None:
            return
        rows = payload.rows
        self.bonus[rows] = payload.bonus_tokens
        if payload.seq_lens is not None:
            self.seq_lens[rows] = payload.seq_lens
        if payload.draft_tokens is not None:
            k = payload.draft_tokens.shape[1]
            self.draft[rows, :k] = payload.draft_tokens
            self.draft_lens[rows] = payload.draft_lens  # type: ignore[assignment]

    def gather_bonus(self, rows: torch.Tensor) -> torch.Tensor:
        tokens = self.bonus[rows]
        if self.debug:
            self._check(tokens, "bonus token")
            self.bonus[rows] = POISON
        return tokens

    def gather_draft(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next verify's input per row: drafts [B, k], valid drafts [B], committed KV length [B]."""
        drafts, lens, seq_lens = self.draft[rows, :k], self.draft_lens[rows].clamp(max=k), self.seq_lens[rows]
        if self.debug:
            self._check(seq_lens, "seq len")
            self.seq_lens[rows] = POISON
        return drafts, lens, seq_lens

    def poison(self, rows: list[int]) -> None:
        """Debug mode: mark rows unwritten again (their request left), so a stale gather is caught."""
        if self.debug and rows:
            idx = torch.tensor(rows, dtype=torch.int64, device=self.bonus.device)
            self.bonus[idx] = POISON
            self.seq_lens[idx] = POISON
            self.draft[idx] = POISON

    @staticmethod
    def _check(values: torch.Tensor, what: str) -> None:
        # raises at once on CPU; a device-side assert on GPUs (no host sync on the hot path)
        torch._assert_async((values != POISON).all(), f"future map: {what} gathered before a step wrote it")

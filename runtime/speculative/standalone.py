"""STANDALONE drafts: a smaller model with the target's tokenizer proposes a greedy chain.

The draft model has its own KV pool, indexed by the target's slots through the same
request-to-token rows, so the draft KV of a position lives in the slot the scheduler reserved
for that position (it reserves K positions past each verify for this). Per row the drafter
tracks `valid`: positions below it hold draft KV of the row's true tokens. A proposal first
catches the draft model up from there to the row's last token (the whole prompt after a
prefill, one or two tokens after a verify) in one extend pass, which yields the first draft,
then runs K - 1 decode passes. Drafts the verify accepted keep their KV valid; the rest is
overwritten by the next proposal. Draft quality never affects correctness, only speed.
"""
from __future__ import annotations

import numpy as np
import torch

from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode
from tandem.runtime.sampling.sampler import greedy_ids


class StandaloneDrafter:
    def __init__(self, model: torch.nn.Module, attn_backend: object, req_to_token: torch.Tensor, num_drafts: int,
                 device: torch.device) -> None:
        self.model, self.attn, self.req_to_token = model, attn_backend, req_to_token
        self.num_drafts = num_drafts
        self.device = device
        # the draft's rotary table ends here; a target with a longer context would take its positions
        # past it, so rows that reach it decode plainly (verifies without drafts) instead
        self.max_position = model.cfg.max_position
        num_rows, width = req_to_token.shape
        self.history = np.zeros((num_rows, width), dtype=np.int64)
        self.valid = np.zeros(num_rows, dtype=np.int64)
        self._fed: dict[int, tuple[int, list[int]]] = {}  # row -> (first position, drafts fed from there)

    def start(self, row: int, tokens: list[int]) -> None:
        self.history[row, :len(tokens)] = tokens
        self.valid[row] = 0
        self._fed.pop(row, None)

    def append(self, row: int, pos: int, tokens: list[int]) -> None:
        """Tokens kept at [pos, pos + n): where they agree with the drafts fed there, their draft KV
        stays valid."""
        start, fed = self._fed.pop(row, (-1, []))
        matched = 0
        if start == pos:
            while matched < min(len(fed), len(tokens)) and fed[matched] == tokens[matched]:
                matched += 1
        self.valid[row] = min(int(self.valid[row]), pos) + matched
        self.history[row, pos:pos + len(tokens)] = tokens

    @torch.inference_mode()
    def propose(self, rows: list[int], seq_lens: list[int], make: list[bool],
                pos_limits: list[int]) -> tuple[np.ndarray, np.ndarray]:
        k = self.num_drafts
        drafts = np.zeros((len(rows), k), dtype=np.int64)
        lens = np.zeros(len(rows), dtype=np.int64)
        # a draft at position p + 1 needs the KV of position p; nothing is written at or past the limit
        # (the request's last position, or the end of the draft model's own positions)
        limits = [min(limit, self.max_position) for limit in pos_limits]
        want = {i: min(k, limit - 1 - last) for i, (last, limit, ok) in enumerate(zip(seq_lens, limits, make))
                if ok and limit - 1 - last >= 1}
        if not want:
            return drafts, lens
        picked = list(want)
        tokens = self._catch_up([rows[i] for i in picked], [seq_lens[i] for i in picked])
        for j in range(k):
            for n, i in enumerate(picked):
                drafts[i, j] = tokens[n]
            picked_next = [i for i in picked if want[i] > j + 1]
            if j + 1 == k or not picked_next:
                break
            keep = [picked.index(i) for i in picked_next]
            tokens = self._decode([rows[i] for i in picked_next], [seq_lens[i] + j + 1 for i in picked_next],
                                  [int(tokens[n]) for n in keep])
            picked = picked_next
        for i, n in want.items():
            lens[i] = n
            self._fed[rows[i]] = (seq_lens[i] + 1, drafts[i, :n - 1].tolist())
        return drafts, lens

    def _catch_up(self, rows: list[int], lasts: list[int]) -> list[int]:
        """Feed each row's true tokens from `valid` through its last one; the first drafts. The last
        token is fed even when its draft KV is valid (a verify that checked fewer drafts than were fed
        kept only tokens that matched them): its logits give the first draft, and a row fed nothing
        would take another row's (all rows so: an empty pass, which took the scheduler down)."""
        starts = [min(int(self.valid[r]), last) for r, last in zip(rows, lasts)]
        ids = np.concatenate([self.history[r, s:last + 1] for r, s, last in zip(rows, starts, lasts)])
        slots = torch.cat([self.req_to_token[r, s:last + 1] for r, s, last in zip(rows, starts, lasts)])
        batch = ForwardBatch.build(ForwardMode.EXTEND, torch.from_numpy(ids), rows, starts,
                                   [last + 1 - s for s, last in zip(starts, lasts)], slots, None, self.device)
        for r, last in zip(rows, lasts):
            self.valid[r] = last + 1
        return self._greedy(batch)

    def _decode(self, rows: list[int], positions: list[int], tokens: list[int]) -> list[int]:
        slots = self.req_to_token[torch.tensor(rows), torch.tensor(positions)]
        batch = ForwardBatch.build(ForwardMode.DECODE, torch.tensor(tokens, dtype=torch.int64), rows, positions,
                                   [1] * len(rows), slots, None, self.device)
        return self._greedy(batch)

    def _greedy(self, batch: ForwardBatch) -> list[int]:
        hidden = self.model.hidden_states(batch, self.attn)
        return greedy_ids(self.model.logits(hidden[batch.logits_indices])).tolist()

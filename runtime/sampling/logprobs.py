"""Device-side logprobs: logsumexp, top-k and requested-id logprobs, chunked over rows.

Which distribution (SGLang's defaults): prompt logprobs are of the model's raw logits; output
logprobs are of the logits the sampler drew from (after the grammar mask, penalties, logit bias
and min-new-tokens bans), divided by each row's temperature (1 for greedy rows), before
top-k/top-p/min-p; the forward worker passes those logits and `temperatures`
(TANDEM_RETURN_ORIGINAL_LOGPROB: no temperature). Everything is computed in float32, and every
value is clamped to float32's minimum, so a masked token reads -3.4e38, never -inf (JSON stays
valid). Work is done `chunk_size` rows at a time, so the float32 working set is O(chunk_size x
vocab) whatever the number of positions: an 8k-token prompt with a 49k vocab never holds an
[8k x 49k] log-softmax. `compute_logprobs_from_hidden` also bounds the logits themselves by
projecting hidden states through the LM head one chunk at a time.

Null representation (shared with tandem.ipc.messages.LogprobArrays): a block of positions has a
`null_prefix` count of leading positions without a value; their float entries are NaN and
their top ids -1. For prompt logprobs that is the first reported position, whatever it is
(SGLang always pads the first input logprob with None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from tandem.ipc.messages import LogprobArrays
from tandem.kernels.cpu_ops import load_cpu_ops

# 512 rows x 49k vocab x 4 B = 100 MB per float32 chunk (plus logsumexp/topk temporaries).
DEFAULT_CHUNK_SIZE = 512
# what a token of probability 0 reads (SGLang: log(probs).clamp(min=finfo(float32).min))
LOGPROB_FLOOR = torch.finfo(torch.float32).min


@dataclass
class LogprobChunk:
    """Per-row results on the logits' device; row r describes logits row r."""

    token_logprobs: torch.Tensor  # float32 [N]; NaN when no token ids were given
    top_vals: torch.Tensor  # float32 [N, k], sorted descending
    top_idx: torch.Tensor  # int32 [N, k]
    ids_logprobs: torch.Tensor  # float32 [N, n] for token_ids_logprob

    def __len__(self) -> int:
        return int(self.token_logprobs.shape[0])

    @staticmethod
    def cat(chunks: Sequence[LogprobChunk]) -> LogprobChunk:
        return LogprobChunk(*(torch.cat([getattr(c, f) for c in chunks]) for f in _FIELDS))

    def slice(self, start: int, stop: int) -> LogprobChunk:
        return LogprobChunk(*(getattr(self, f)[start:stop] for f in _FIELDS))

    def to_numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(token_logprobs, top_vals, top_idx, ids_logprobs) on the host; one transfer each."""
        return tuple(getattr(self, f).cpu().numpy() for f in _FIELDS)  # type: ignore[return-value]

    def to_arrays(self, token_ids: np.ndarray | Sequence[int], null_prefix: int = 0) -> LogprobArrays:
        """Host block for the formatter; the first `null_prefix` rows are blanked."""
        tok, vals, idx, ids_lp = self.to_numpy()
        if null_prefix > 0:  # CPU tensors share memory with .numpy(): blank copies instead
            tok, vals, idx, ids_lp = tok.copy(), vals.copy(), idx.copy(), ids_lp.copy()
        arrays = LogprobArrays(token_logprobs=tok, token_ids=np.asarray(token_ids, np.int32), top_vals=vals,
                               top_idx=idx, ids_logprobs=ids_lp)
        return with_null_prefix(arrays, null_prefix)


_FIELDS = ("token_logprobs", "top_vals", "top_idx", "ids_logprobs")


def with_null_prefix(arrays: LogprobArrays, null_prefix: int) -> LogprobArrays:
    """Blank the first rows in place (NaN values, -1 ids) and record the count."""
    p = min(null_prefix, len(arrays))
    if p:
        arrays.token_logprobs[:p] = np.nan
        arrays.top_vals[:p] = np.nan
        arrays.top_idx[:p] = -1
        arrays.ids_logprobs[:p] = np.nan
    arrays.null_prefix = p
    return arrays


def compute_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor | None,
    top_logprobs_num: int,
    token_ids_logprob: Sequence[int] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperatures: torch.Tensor | None = None,
) -> LogprobChunk:
    """Logprobs for each row of `logits` [N, V] (any float dtype).

    token_ids [N]: the token whose logprob row i reports (None -> NaN). top_logprobs_num is clamped to V.
    temperatures [N]: row i's logits are divided by temperatures[i] first (None: as they are).
    """
    return compute_logprobs_from_hidden(
        logits, _identity, token_ids, top_logprobs_num, token_ids_logprob, chunk_size, temperatures
    )


def compute_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    token_ids: torch.Tensor | None,
    top_logprobs_num: int,
    token_ids_logprob: Sequence[int] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperatures: torch.Tensor | None = None,
) -> LogprobChunk:
    """Like compute_logprobs, projecting `hidden` [N, H] to logits one chunk at a time, so
    neither the logits nor their log-softmax ever exist for all N rows at once."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    n, dev = hidden.shape[0], hidden.device
    req_ids = None
    if token_ids_logprob:
        req_ids = torch.as_tensor(list(token_ids_logprob), dtype=torch.long, device=dev)
    out = None
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        # shifted by the row's max first, as the sampler (a logit_bias near float32's maximum divided
        # by a temperature < 1 would be inf, and its log-softmax NaN), and always: a prompt position's
        # logprob then has the bits of the same token's output logprob (x - max - lse rounds otherwise
        # than x - lse), so a teacher-forced scoring reproduces a rollout's logprobs exactly
        x = lm_head(hidden[start:stop]).float()
        x = x - x.amax(dim=-1, keepdim=True)
        if temperatures is not None:
            x = x / temperatures[start:stop, None].to(x)
        if out is None:
            out = _allocate(n, max(0, min(top_logprobs_num, x.shape[1])), len(token_ids_logprob or ()), dev)
            _check_ids(req_ids, x.shape[1])
        ids = None if token_ids is None else token_ids[start:stop].to(dev, torch.long)
        _fill_rows(out, start, stop, x, ids, req_ids)
    if out is None:  # no rows: the vocab size is unknown, so k cannot be clamped
        out = _allocate(0, max(0, top_logprobs_num), len(token_ids_logprob or ()), dev)
    return out


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _allocate(n: int, k: int, num_ids: int, dev: torch.device) -> LogprobChunk:
    f32 = dict(dtype=torch.float32, device=dev)
    return LogprobChunk(
        torch.full((n,), float("nan"), **f32), torch.empty((n, k), **f32),
        torch.empty((n, k), dtype=torch.int32, device=dev), torch.empty((n, num_ids), **f32),
    )


def _check_ids(req_ids: torch.Tensor | None, vocab: int) -> None:
    if req_ids is not None and req_ids.numel() and int(req_ids.max()) >= vocab:
        raise ValueError(f"token_ids_logprob has an id >= vocab size {vocab}")


def _fill_rows(out: LogprobChunk, start: int, stop: int, x: torch.Tensor,
               ids: torch.Tensor | None, req_ids: torch.Tensor | None) -> None:
    """x: float32 logits for rows [start, stop); writes their logprob results into out. Only the
    picked values are clamped (-inf logits read LOGPROB_FLOOR), never the whole [n, V] block."""
    lse = _logsumexp(x)
    if ids is not None:
        out.token_logprobs[start:stop] = _floored(x.gather(1, ids[:, None]) - lse).squeeze(1)
    k = out.top_vals.shape[1]
    if k:
        vals, idx = torch.topk(x, k, dim=-1)
        out.top_vals[start:stop] = _floored(vals - lse)
        out.top_idx[start:stop] = idx.to(torch.int32)
    if req_ids is not None:
        out.ids_logprobs[start:stop] = _floored(x.index_select(1, req_ids) - lse)


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[n, 1]; on CPU the C++ op, whose row sums do not depend on n or the thread count (torch's
    split a row across threads when n is small: logprobs changed with the batch)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] and (ops := load_cpu_ops()) is not None:
        return ops.logsumexp_rows(x)[:, None]
    return torch.logsumexp(x, dim=-1, keepdim=True)


def _floored(logprobs: torch.Tensor) -> torch.Tensor:
    return logprobs.clamp(min=LOGPROB_FLOOR)


def batch_output_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    top_logprobs_nums: Sequence[int],
    token_ids_logprobs: Sequence[Sequence[int] | None],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperatures: torch.Tensor | None = None,
) -> list[LogprobArrays]:
    """Output logprobs for one decode step: row r is the logits request r sampled from (see the
    module docstring), its sampled token and its temperature (None: not scaled).

    One pass with the largest k and the union of requested ids, one host transfer, then each
    row is cut down to its own k and ids. Returns a one-position block per row.
    """
    union = sorted({t for ids in token_ids_logprobs if ids for t in ids})
    chunk = compute_logprobs(logits, token_ids, max(top_logprobs_nums, default=0), union, chunk_size, temperatures)
    tok, vals, idx, ids_lp = chunk.to_numpy()
    sampled = token_ids.cpu().numpy().astype(np.int32)
    col = {t: c for c, t in enumerate(union)}
    out = []
    for r, (k, ids) in enumerate(zip(top_logprobs_nums, token_ids_logprobs)):
        cols = [col[t] for t in ids] if ids else []
        out.append(LogprobArrays(token_logprobs=tok[r:r + 1], token_ids=sampled[r:r + 1], top_vals=vals[r:r + 1, :k],
                                 top_idx=idx[r:r + 1, :k], ids_logprobs=ids_lp[r:r + 1, cols]))
    return out


class InputLogprobAccumulator:
    """Collects a request's prompt logprobs across chunked-prefill passes.

    Positions: prompt position i >= 1 gets its values from logits row i-1 (that row predicts
    token i). Reported positions are [start, P), one entry each, with start = the effective
    logprob_start_len (LogprobParams.input_start; negative: none). As in SGLang, the first
    reported position is always null (null_prefix = 1), whatever start is: position 0 has no
    predecessor, and for start > 0 SGLang pads rather than report row start-1. So the needed
    logits rows are [start, P-1) (`rows_needed`), and start = P-1 (SGLang's default when a request
    gives -1) needs none. Logits row P-1 predicts the first output token and is not an input
    logprob. A prefix-cache hit must not skip any needed row.
    """

    def __init__(self, prompt_ids: Sequence[int] | np.ndarray, logprob_start_len: int,
                 top_logprobs_num: int, token_ids_logprob: Sequence[int] | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.prompt = np.asarray(prompt_ids, dtype=np.int64)
        p = len(self.prompt)
        self.start = p if logprob_start_len < 0 else min(logprob_start_len, p)
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = list(token_ids_logprob) if token_ids_logprob else None
        self.chunk_size = chunk_size
        self.rows_needed = range(self.start, max(p - 1, self.start))
        self._next_row = self.rows_needed.start
        self._chunks: list[LogprobChunk] = []

    @property
    def done(self) -> bool:
        return self._next_row >= self.rows_needed.stop

    @property
    def next_row(self) -> int:
        """The first logits row still to come (= the prompt position whose hidden row it is)."""
        return self._next_row

    def add_logits(self, logits: torch.Tensor, first_row: int) -> None:
        """logits [n, V] for prompt rows [first_row, first_row + n) of one prefill pass."""
        lo, hi = self._clip(first_row, logits.shape[0])
        if lo >= hi:
            return
        nxt = torch.from_numpy(self.prompt[lo + 1:hi + 1])
        chunk = compute_logprobs(logits[lo - first_row:hi - first_row], nxt, self.top_logprobs_num,
                                 self.token_ids_logprob, self.chunk_size)
        self._append(chunk, lo, hi)

    def add_chunk(self, chunk: LogprobChunk, first_row: int) -> None:
        """Precomputed results for rows [first_row, first_row + len(chunk)); each row's token
        logprob must be that of the next prompt token."""
        lo, hi = self._clip(first_row, len(chunk))
        if lo < hi:
            self._append(chunk.slice(lo - first_row, hi - first_row), lo, hi)

    def _clip(self, first_row: int, n: int) -> tuple[int, int]:
        lo = max(first_row, self._next_row)
        hi = min(first_row + n, self.rows_needed.stop)
        if lo < hi and first_row > self._next_row:
            raise ValueError(f"prompt logits rows skipped: expected row {self._next_row}, "
                             f"got {first_row}")
        return lo, hi

    def _append(self, chunk: LogprobChunk, lo: int, hi: int) -> None:
        self._chunks.append(chunk)
        self._next_row = hi

    def finalize(self) -> LogprobArrays:
        """Host arrays for positions [start, P); one device-to-host transfer per field."""
        if not self.done:
            raise ValueError(f"prompt logprobs incomplete: next row {self._next_row} of "
                             f"{self.rows_needed.stop}")
        k, n_ids = self.top_logprobs_num, len(self.token_ids_logprob or ())
        null = 1 if self.start < len(self.prompt) else 0
        if self._chunks:
            tok, vals, idx, ids_lp = LogprobChunk.cat(self._chunks).to_numpy()
            k = vals.shape[1]
        else:
            tok, vals, idx = np.zeros(0, np.float32), np.zeros((0, k), np.float32), np.zeros((0, k), np.int32)
            ids_lp = np.zeros((0, n_ids), np.float32)
        arrays = LogprobArrays(
            token_logprobs=np.concatenate([np.zeros(null, np.float32), tok]),
            token_ids=self.prompt[self.start:].astype(np.int32),
            top_vals=np.concatenate([np.zeros((null, k), np.float32), vals]),
            top_idx=np.concatenate([np.zeros((null, k), np.int32), idx]),
            ids_logprobs=np.concatenate([np.zeros((null, n_ids), np.float32), ids_lp]),
        )
        return with_null_prefix(arrays, null)

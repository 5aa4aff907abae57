"""Host-side formatting of logprob arrays into SGLang's `/generate` meta_info keys.

Logprobs stay float32/int32 numpy arrays until this module turns them into the response.
Two output shapes, with SGLang's exact key names:

* nested (default): `{side}_token_logprobs` is a list of `(logprob, token_id, text|None)`
  triples; `{side}_top_logprobs` a list of rows of triples (None for a null row);
  `{side}_token_ids_logprobs` likewise for the requested token ids;
  `output_token_logprobs_length` the number of output entries.
* flat (opt-in per side): `{side}_top_logprobs_val_flat` / `_idx_flat` / `_shape` /
  `_null_prefix`; entry j of covered position i sits at `flat[(i - null_prefix) * k + j]`.
  With b64, `_val_flat_b64` / `_idx_flat_b64` (little-endian float32 / int32, base64)
  plus `_val_flat_b64_dtype` / `_idx_flat_b64_dtype` replace the plain flat lists.

Null representation (`tandem.ipc.messages.LogprobArrays`, shared with logprobs.py): a block
has `null_prefix` leading rows without a value; their float entries are NaN and top ids -1.
The prompt side always starts with exactly one (SGLang pads the first input entry with None,
whatever logprob_start_len is), so `input_top_logprobs_null_prefix` is 1 whenever there are
input entries. Only a leading run of null rows is representable flat; anything else falls back
to nested.
"""
from __future__ import annotations

import base64
import gc
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import orjson

from tandem.ipc.messages import LogprobArrays

logger = logging.getLogger(__name__)

DecodeTokens = Callable[[list[int]], list[str]]
SIDES = ("input", "output")


class FlatFormatError(ValueError):
    """The top rows cannot be represented in the flat format (request falls back to nested)."""


@dataclass(frozen=True)
class LogprobFormatOptions:
    """The logprob-related fields of a `/generate` request, validated."""

    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False
    flat_input_top: bool = False  # return_flat_raw_top_logprobs
    flat_output_top: bool = False  # return_flat_raw_output_top_logprobs
    flat_b64: bool = False  # return_flat_raw_top_logprobs_b64
    # Leave numpy arrays in the plain flat fields: smaller JSON (shortest float32 repr) but
    # the encoder must be orjson with OPT_SERIALIZE_NUMPY (see encode_json).
    json_arrays: bool = False


def encode_json(obj: Any) -> bytes:
    """orjson with numpy support: required when LogprobFormatOptions.json_arrays is set."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


# ---- nested builders (pure functions; whole-array tolist, then zip) -------------------------


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building nested rows: the tens of thousands of tuples and
    lists would otherwise trigger repeated collections (about 3x slower at 32k positions),
    and these containers cannot form cycles."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _texts(ids: list[int], decode: DecodeTokens | None) -> Any:
    return decode(ids) if decode is not None else repeat(None)


def nested_token_triples(
    logprobs: np.ndarray, ids: np.ndarray, null_prefix: int, decode: DecodeTokens | None = None
) -> list[tuple]:
    """[(logprob|None, token_id, text|None)] per position; the null prefix gets None logprobs."""
    vals = logprobs.tolist()
    vals[:null_prefix] = [None] * min(null_prefix, len(vals))
    id_list = ids.tolist()
    return list(zip(vals, id_list, _texts(id_list, decode)))


def nested_top_rows(
    vals: np.ndarray, idx: np.ndarray, null_prefix: int, decode: DecodeTokens | None = None
) -> list[list[tuple] | None]:
    """One row of (logprob, token_id, text|None) triples per position; None for null rows."""
    n = vals.shape[0]
    head: list[list[tuple] | None] = [None] * min(null_prefix, n)
    val_rows = vals[null_prefix:].tolist()
    idx_rows = idx[null_prefix:].tolist()
    if decode is None:
        return head + [list(zip(v, i, repeat(None))) for v, i in zip(val_rows, idx_rows)]
    k = vals.shape[1]
    texts = decode(idx[null_prefix:].reshape(-1).tolist())
    return head + [
        list(zip(v, i, texts[r * k:(r + 1) * k]))
        for r, (v, i) in enumerate(zip(val_rows, idx_rows))
    ]


def nested_ids_rows(
    vals: np.ndarray, token_ids: Sequence[int], null_prefix: int,
    decode: DecodeTokens | None = None,
) -> list[list[tuple] | None]:
    """token_ids_logprob rows: the requested ids are the same at every position."""
    n = vals.shape[0]
    ids = list(token_ids)
    texts = decode(ids) if decode is not None else [None] * len(ids)
    head: list[list[tuple] | None] = [None] * min(null_prefix, n)
    return head + [list(zip(v, ids, texts)) for v in vals[null_prefix:].tolist()]


# ---- flat builders --------------------------------------------------------------------------


def flat_representable(parts: Sequence[LogprobArrays]) -> str | None:
    """None when the concatenated top rows are rectangular with nulls only in the leading
    prefix; otherwise the reason they are not."""
    widths = {p.top_vals.shape[1] for p in parts if len(p)}
    if len(widths) > 1:
        return f"top rows are not rectangular (row widths {sorted(widths)})"
    pos, seen_row = 0, False
    for p in parts:
        if seen_row and p.null_prefix > 0:
            return f"null row at position {pos} after the leading null prefix"
        seen_row = seen_row or p.null_prefix < len(p)
        pos += len(p)
    return None


def concat_parts(parts: Sequence[LogprobArrays]) -> LogprobArrays:
    """Concatenate blocks; null_prefix is the leading run of null rows across them."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return LogprobArrays.empty()
    prefix = 0
    for p in parts:
        prefix += p.null_prefix
        if p.null_prefix < len(p):
            break
    cat = np.concatenate
    return LogprobArrays(
        token_logprobs=cat([p.token_logprobs for p in parts]), token_ids=cat([p.token_ids for p in parts]),
        top_vals=cat([p.top_vals for p in parts]), top_idx=cat([p.top_idx for p in parts]),
        ids_logprobs=cat([p.ids_logprobs for p in parts]), null_prefix=prefix,
    )


def _b64(arr: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype=dtype).tobytes()).decode("ascii")


def flat_top_fields(
    side: str, vals: np.ndarray, idx: np.ndarray, null_prefix: int,
    b64: bool = False, json_arrays: bool = False,
) -> dict[str, Any]:
    """The `{side}_top_logprobs_*` flat keys for rectangular [M, k] rows."""
    if vals.ndim != 2 or vals.shape != idx.shape:
        raise FlatFormatError(f"top rows are not rectangular (shapes {vals.shape}, {idx.shape})")
    prefix = min(null_prefix, vals.shape[0])
    v, i = vals[prefix:], idx[prefix:]
    key = f"{side}_top_logprobs"
    out: dict[str, Any] = {}
    if b64:
        out[f"{key}_val_flat_b64"] = _b64(v, "<f4")
        out[f"{key}_idx_flat_b64"] = _b64(i, "<i4")
        out[f"{key}_val_flat_b64_dtype"] = "float32"
        out[f"{key}_idx_flat_b64_dtype"] = "int32"
    elif json_arrays:
        out[f"{key}_val_flat"] = np.ascontiguousarray(v, np.float32).reshape(-1)
        out[f"{key}_idx_flat"] = np.ascontiguousarray(i, np.int32).reshape(-1)
    else:
        out[f"{key}_val_flat"] = v.reshape(-1).tolist()
        out[f"{key}_idx_flat"] = i.reshape(-1).tolist()
    out[f"{key}_shape"] = [int(v.shape[0]), int(v.shape[1])]
    out[f"{key}_null_prefix"] = prefix
    return out


def decode_flat_top(meta: Mapping[str, Any], side: str = "input") -> tuple[np.ndarray, np.ndarray, int]:
    """Client side: (vals [rows, k] float32, idx [rows, k] int32, null_prefix) from a response."""
    key = f"{side}_top_logprobs"
    shape = tuple(meta[f"{key}_shape"])
    if f"{key}_val_flat_b64" in meta:
        v = np.frombuffer(base64.b64decode(meta[f"{key}_val_flat_b64"]),
                          np.dtype(meta[f"{key}_val_flat_b64_dtype"]))
        i = np.frombuffer(base64.b64decode(meta[f"{key}_idx_flat_b64"]),
                          np.dtype(meta[f"{key}_idx_flat_b64_dtype"]))
    else:
        v = np.asarray(meta[f"{key}_val_flat"], np.float32)
        i = np.asarray(meta[f"{key}_idx_flat"], np.int32)
    return v.reshape(shape), i.reshape(shape), int(meta[f"{key}_null_prefix"])


# ---- per-request formatter with caches ------------------------------------------------------


@dataclass
class _SideState:
    """Blocks received for one side plus the already-built response values."""

    parts: list[LogprobArrays] = field(default_factory=list)
    rows: int = 0
    built_parts: int = 0  # parts already converted into the nested lists below
    token: list = field(default_factory=list)
    top: list = field(default_factory=list)
    ids: list = field(default_factory=list)
    flat_rows: int = -1  # row count the cached flat fields were built for
    flat: dict[str, Any] | None = None
    fallback: str | None = None


class LogprobFormatter:
    """Builds a request's logprob meta_info keys; one per request, reused across stream chunks.

    New positions are appended with extend_input/extend_output; meta_info() converts only the
    blocks not yet converted. Each returned list is a snapshot: growth replaces the cached list
    with a new one (old + new), so a dict returned earlier never changes under its reader,
    and an unchanged value is returned as the very same object.
    """

    def __init__(self, options: LogprobFormatOptions, decode_tokens: DecodeTokens | None = None,
                 rid: str = "") -> None:
        self.options = options
        self.rid = rid
        self._decode = decode_tokens if options.return_text_in_logprobs else None
        self._sides = {s: _SideState() for s in SIDES}

    def extend_input(self, arrays: LogprobArrays) -> None:
        self._extend("input", arrays)

    def extend_output(self, arrays: LogprobArrays) -> None:
        self._extend("output", arrays)

    @property
    def fallback_reasons(self) -> dict[str, str]:
        """Per side, why a requested flat format fell back to nested (empty when none did)."""
        return {s: st.fallback for s, st in self._sides.items() if st.fallback}

    def _extend(self, side: str, arrays: LogprobArrays) -> None:
        if len(arrays):
            st = self._sides[side]
            st.parts.append(arrays)
            st.rows += len(arrays)

    def meta_info(self) -> dict[str, Any]:
        """The logprob keys of meta_info, for everything received so far."""
        out: dict[str, Any] = {}
        for side in SIDES:
            self._side_meta(side, out)
        return out

    def _wants_flat(self, side: str) -> bool:
        o = self.options
        return o.top_logprobs_num > 0 and (o.flat_input_top if side == "input" else o.flat_output_top)

    def _side_meta(self, side: str, out: dict[str, Any]) -> None:
        st = self._sides[side]
        flat = self._flat_fields(side, st) if self._wants_flat(side) else None
        self._build_nested(st, with_top=flat is None)
        out[f"{side}_token_logprobs"] = st.token
        if side == "output":
            # SGLang's add_logprob_to_meta_info: streaming clients (slime, miles) read the count
            # from this key to place a chunk's logprobs without re-counting the list.
            out["output_token_logprobs_length"] = len(st.token)
        if self.options.top_logprobs_num > 0:
            if flat is None:
                out[f"{side}_top_logprobs"] = st.top
            else:
                out.update(flat)
        if self.options.token_ids_logprob is not None:
            out[f"{side}_token_ids_logprobs"] = st.ids

    def _build_nested(self, st: _SideState, with_top: bool) -> None:
        new = st.parts[st.built_parts:]
        if not new:
            return
        token: list = []
        top: list = []
        ids: list = []
        with gc_paused():
            self._build_parts(new, token, top, ids, with_top)
        st.token = st.token + token
        st.top = st.top + top if top else st.top
        st.ids = st.ids + ids if ids else st.ids
        st.built_parts = len(st.parts)

    def _build_parts(self, new: list[LogprobArrays], token: list, top: list, ids: list,
                     with_top: bool) -> None:
        o, dec = self.options, self._decode
        for p in new:
            token += nested_token_triples(p.token_logprobs, p.token_ids, p.null_prefix, dec)
            if with_top and o.top_logprobs_num > 0:
                top += nested_top_rows(p.top_vals, p.top_idx, p.null_prefix, dec)
            if o.token_ids_logprob is not None:
                ids += nested_ids_rows(p.ids_logprobs, o.token_ids_logprob, p.null_prefix, dec)

    def _flat_fields(self, side: str, st: _SideState) -> dict[str, Any] | None:
        if st.fallback is not None:
            return None
        if st.flat_rows == st.rows:
            return st.flat
        reason = flat_representable(st.parts)
        if reason is None:
            cat = concat_parts(st.parts) if st.parts else LogprobArrays.empty(
                self.options.top_logprobs_num)
            o = self.options
            try:
                st.flat = flat_top_fields(side, cat.top_vals, cat.top_idx, cat.null_prefix,
                                          o.flat_b64, o.json_arrays)
                st.flat_rows = st.rows
                return st.flat
            except FlatFormatError as exc:
                reason = str(exc)
        self._fall_back(side, st, reason)
        return None

    def _fall_back(self, side: str, st: _SideState, reason: str) -> None:
        # Sticky: once nested, the side stays nested, so stream chunks never switch format.
        st.fallback = reason
        st.flat, st.flat_rows = None, -1
        st.built_parts, st.token, st.top, st.ids = 0, [], [], []
        logger.warning("request %s: flat %s top logprobs fall back to nested: %s",
                       self.rid or "?", side, reason)

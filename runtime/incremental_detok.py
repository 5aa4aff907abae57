"""Incremental detokenization for streamed output tokens (pure logic, used by the detokenizer).

Each request keeps a `DecodeState`. Decoding the whole output every step is quadratic, so, like
SGLang, a state keeps two cursors into its token ids:

- `surrogate_offset`: start of a short window of already-committed tokens that is decoded again
  as context (some tokenizers render a token differently depending on what precedes it, e.g.
  SentencePiece's leading space), and
- `read_offset`: end of the committed tokens.

A step decodes `ids[surrogate_offset:]` and `ids[surrogate_offset:read_offset]`; the new text is
the first minus the prefix that the second accounts for. New text ending in U+FFFD means a
multi-byte character is split across tokens, so it stays uncommitted until a later token completes
it (or the request finishes). On commit both cursors move forward, so the window stays about one
step's tokens long whatever the output length.

On top of that, stop strings cut the text at the first match and hold back any tail that could
still grow into a stop string, so a client never sees text it would have to un-see.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class DecodeState:
    """Incremental detokenization state of one request (output tokens only, no prompt tail)."""

    def __init__(
        self,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop_strings: Sequence[str] = (),
        no_stop_trim: bool = False,
        tokenizer: Any = None,
    ) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # An empty stop string would match everywhere; it cannot mean anything useful.
        self.stop_strings: list[str] = [s for s in stop_strings if s]
        self.no_stop_trim = no_stop_trim
        self.tokenizer = tokenizer  # only needed by add(); decode_batch() passes its own
        self.ids: list[int] = []
        self.surrogate_offset = 0
        self.read_offset = 0
        self.text = ""  # everything emitted so far
        self.stop_matched: str | None = None
        self.finished = False
        self._decoded = ""  # committed decoded text, before stop handling
        self._scanned = 0  # prefix of _decoded known to contain no stop string
        self._max_stop = max((len(s) for s in self.stop_strings), default=0)

    # -- public -------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once nothing more can ever be emitted (finished or a stop string was matched)."""
        return self.finished or self.stop_matched is not None

    @property
    def decode_options(self) -> tuple[bool, bool]:
        """The batch_decode kwargs this state needs; decode_batch groups states by it."""
        return (self.skip_special_tokens, self.spaces_between_special_tokens)

    def add(self, new_ids: Sequence[int], finished: bool) -> str:
        """Append `new_ids`, decode the window with `self.tokenizer`; return the text to emit now."""
        if self.tokenizer is None:
            raise ValueError("DecodeState.add needs a tokenizer; pass tokenizer= or use decode_batch")
        return decode_batch(self.tokenizer, [self], [new_ids], [finished])[0]

    # -- two-phase step used by decode_batch ----------------------------------------------------

    def _extend(self, new_ids: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """Record tokens; return (surrogate window, read window) to decode, or None if no decode."""
        if self.done:
            return None  # tokens past a stop string or after finish can never show up
        self.ids.extend(int(t) for t in new_ids)
        if self.read_offset == len(self.ids):
            return None  # nothing uncommitted to decode
        return self.ids[self.surrogate_offset : self.read_offset], self.ids[self.surrogate_offset :]

    def _advance(self, surrogate_text: str, read_text: str, finished: bool) -> str:
        """Commit the decoded new text (unless incomplete), apply stop strings; return the delta."""
        if self.done:
            return ""
        new_text = read_text[len(surrogate_text) :]
        if new_text and (finished or not new_text.endswith(REPLACEMENT_CHAR)):
            self._decoded += new_text
            self.surrogate_offset = self.read_offset
            self.read_offset = len(self.ids)
        visible = self._visible_text(finished)
        self.finished = finished
        delta = visible[len(self.text) :]
        self.text = visible
        return delta

    # -- stop strings ---------------------------------------------------------------------------

    def _visible_text(self, finished: bool) -> str:
        """The part of the committed text that may be shown now."""
        if not self.stop_strings:
            return self._decoded
        cut = self._find_stop()
        if cut is not None:
            return self._decoded[:cut]
        self._scanned = len(self._decoded)
        if finished:
            return self._decoded
        return self._decoded[: len(self._decoded) - self._stop_prefix_len()]

    def _find_stop(self) -> int | None:
        """Set stop_matched to the stop string that completes first; return where text ends."""
        # Text before _scanned held no full match, so a new match must end after it.
        start = max(0, self._scanned - self._max_stop + 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop_strings:
            pos = self._decoded.find(stop, start)
            if pos < 0:
                continue
            # Earliest end is what a char-by-char stream would hit first; ties: longest match.
            cand = (pos + len(stop), pos, stop)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return None
        end, pos, self.stop_matched = best
        return end if self.no_stop_trim else pos

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        text = self._decoded
        longest = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


def decode_batch(
    tokenizer: Any,
    states: list[DecodeState],
    new_ids: list[Sequence[int]],
    finished: list[bool],
) -> list[str]:
    """Advance every state by its new tokens; return each one's delta text.

    All windows of states sharing decode options go through a single tokenizer.batch_decode call
    (surrogate and read windows together), which is what keeps per-step cost low for big batches.
    """
    if not len(states) == len(new_ids) == len(finished):
        raise ValueError("decode_batch: states, new_ids and finished must have the same length")
    windows = [s._extend(ids) for s, ids in zip(states, new_ids)]
    texts = _decode_windows(tokenizer, states, windows)
    out: list[str] = []
    for state, pair, fin in zip(states, texts, finished):
        surrogate_text, read_text = pair if pair is not None else ("", "")
        out.append(state._advance(surrogate_text, read_text, fin))
    return out


def _decode_windows(
    tokenizer: Any,
    states: list[DecodeState],
    windows: list[tuple[list[int], list[int]] | None],
) -> list[tuple[str, str] | None]:
    """Decode (surrogate, read) windows, one batch_decode call per distinct option group."""
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, (state, pair) in enumerate(zip(states, windows)):
        if pair is not None:
            groups.setdefault(state.decode_options, []).append(i)
    texts: list[tuple[str, str] | None] = [None] * len(states)
    for (skip, spaces), rows in groups.items():
        seqs = [windows[i][0] for i in rows] + [windows[i][1] for i in rows]  # type: ignore[index]
        decoded = tokenizer.batch_decode(
            seqs, skip_special_tokens=skip, spaces_between_special_tokens=spaces
        )
        for j, i in enumerate(rows):
            texts[i] = (decoded[j], decoded[len(rows) + j])
    return texts

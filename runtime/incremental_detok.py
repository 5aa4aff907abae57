"""Incremental detokenization for streamed output tokens (pure logic, used by the detokenizer).

Each request keeps a `DecodeState`. Decoding the whole output every step is quadratic, so, like
SGLang, a state keeps two cursors into its token ids:

- `surrogate_offset`: start of a short window of already-committed tokens that is decoded again
  as context (some tokenizers render a token differently depending on what precedes it, e.g.
  SentencePiece's leading space), and
- `read_offset`: end of the committed tokens.

The ids start with the prompt's last few tokens (`context_ids`), committed but never shown, so the
first output token is decoded after them as SGLang does: a SentencePiece tokenizer (Llama-2,
Mistral) drops the leading space of whatever text a decode starts with.

A step decodes `ids[surrogate_offset:]` and `ids[surrogate_offset:read_offset]`; the new text is
the first minus the prefix that the second accounts for. New text ending in U+FFFD means a
multi-byte character is split across tokens, so it stays uncommitted until a later token completes
it (or the request finishes). On commit both cursors move forward, so the window stays about one
step's tokens long whatever the output length.

Stops are the scheduler's decision (it ends the request at the token that completes a stop): a
state only applies it, as SGLang's detokenizer does. At finish a matched stop token's text is
dropped, and a matched stop string cut off where the last token completed it (with
no_stop_trim both stay, and so does the rest of the last token's text, as in SGLang); before
finish, a tail that could still grow into a stop string is held back, so a client never sees
text it would have to un-see. A stop string in the text that did not end the
request (the last allowed token ends by length; special tokens this state skips but the
scheduler's decode keeps) is ordinary text.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard, Union

Matched = Union[int, str, None]  # FinishReason.matched: the stop token id or stop string, if any

REPLACEMENT_CHAR = "\ufffd"


class DecodeState:
    """Incremental detokenization state of one request."""

    def __init__(
        self,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop_strings: Sequence[str] = (),
        no_stop_trim: bool = False,
        tokenizer: Any = None,
        context_ids: Sequence[int] = (),
    ) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # An empty stop string would match everywhere; it cannot mean anything useful.
        self.stop_strings: list[str] = [s for s in stop_strings if s]
        self._stop_tails = [StopTail(s) for s in self.stop_strings]
        self.no_stop_trim = no_stop_trim
        self.tokenizer = tokenizer  # only needed by add(); decode_batch() passes its own
        self.ids: list[int] = [int(t) for t in context_ids]
        self.context_len = len(self.ids)
        self.surrogate_offset = 0
        self.read_offset = self.context_len
        self.text = ""  # everything emitted so far
        self.finished = False
        self._decoded = ""  # committed decoded text, before stop handling

    # -- public -------------------------------------------------------------------------------

    @property
    def decode_options(self) -> tuple[bool, bool]:
        """The batch_decode kwargs this state needs; decode_batch groups states by it."""
        return (self.skip_special_tokens, self.spaces_between_special_tokens)

    def add(self, new_ids: Sequence[int], finished: bool, matched: Matched = None) -> str:
        """Append `new_ids`, decode the window with `self.tokenizer`; return the text to emit now.
        `matched`: the stop the request finished on (with finished=True)."""
        if self.tokenizer is None:
            raise ValueError("DecodeState.add needs a tokenizer; pass tokenizer= or use decode_batch")
        return decode_batch(self.tokenizer, [self], [new_ids], [finished], [matched])[0]

    # -- two-phase step used by decode_batch ----------------------------------------------------

    def _extend(self, new_ids: Sequence[int], finished: bool, matched: Matched) -> list[list[int]]:
        """Record tokens; return the windows to decode: none, or the surrogate and read windows,
        and for a request ending on a stop string also all its tokens but the last (the cut must
        find the occurrence that last token completes), then the context alone (to take off)."""
        if self.finished:
            return []  # tokens after finish can never show up
        ids = [int(t) for t in new_ids]
        if finished and isinstance(matched, int) and not self.no_stop_trim and ids and ids[-1] == matched:
            ids.pop()  # the stop token is the request's last; its text is not part of the output
        self.ids.extend(ids)
        windows = [self.ids[self.surrogate_offset : self.read_offset], self.ids[self.surrogate_offset :]]
        if finished and self._cuts(matched) and len(self.ids) > self.context_len:
            return [*windows, self.ids[:-1], self.ids[:self.context_len]]
        return windows if self.read_offset < len(self.ids) else []

    def _advance(self, texts: list[str], finished: bool, matched: Matched) -> str:
        """Commit the decoded new text (unless incomplete), apply stop strings; return the delta.
        `texts`: _extend's windows decoded."""
        if self.finished:
            return ""
        surrogate_text, read_text = texts[:2] if texts else ("", "")
        if self.read_offset == self.context_len:  # before the first commit: the window is the prompt's tail
            surrogate_text = context_text(surrogate_text, read_text)
        new_text = read_text[len(surrogate_text) :]
        if new_text and (finished or not new_text.endswith(REPLACEMENT_CHAR)):
            self._decoded += new_text
            for tail in self._stop_tails:
                tail.feed(new_text)
            self.surrogate_offset = self.read_offset
            self.read_offset = len(self.ids)
        before_last = texts[2][len(texts[3]):] if len(texts) > 2 else ""  # the output's, without the context
        visible = self._visible_text(finished, matched, before_last)
        self.finished = finished
        delta = visible[len(self.text) :]
        self.text = visible
        return delta

    # -- stop strings ---------------------------------------------------------------------------

    def _visible_text(self, finished: bool, matched: Matched, before_last: str) -> str:
        """The part of the committed text that may be shown now."""
        if finished:
            if self._cuts(matched):
                return self._decoded[:self._stop_cut(matched, before_last)]
            return self._decoded
        if not self.stop_strings:
            return self._decoded
        return self._decoded[: len(self._decoded) - self._stop_prefix_len()]

    def _cuts(self, matched: Matched) -> TypeGuard[str]:
        """Whether the finish cuts a matched stop string off the text. With no_stop_trim nothing
        is cut: the text is all the output's tokens, the last one whole even where the stop ends
        inside it, as SGLang's trim_matched_stop returns it."""
        return isinstance(matched, str) and not self.no_stop_trim

    def _stop_cut(self, stop: str, before_last: str) -> int:
        """Where the text ends for a request the scheduler stopped at `stop`: at the occurrence
        its last token completed (completed_at). Not found (a rendering the scheduler's decode
        does not share): nothing is cut. Never before what was already emitted."""
        pos = completed_at(self._decoded, stop, before_last)
        if pos < 0:
            return len(self._decoded)
        return max(pos, len(self.text))

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        return max((tail.held for tail in self._stop_tails), default=0)


class StopTail:
    """One stop string's KMP matcher over a text that only grows: `held` is the length of the
    longest tail of the text fed so far that is a proper prefix of the stop (text that may still
    become it). Each fed character costs amortized O(1), and the failure table is built only as
    far as the text reaches: testing every tail length against the stop at every step cost the
    detokenizer O(len(stop)^2) per step (32 stops of 10k characters: 50 ms a step, for every
    request behind it)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.held = 0
        self._fail = [0]  # _fail[j]: length of the longest proper border of stop[:j + 1]

    def feed(self, text: str) -> None:
        stop, last, q = self.stop, len(self.stop) - 1, self.held
        for ch in text:
            while q and stop[q] != ch:
                q = self._border(q - 1)
            if stop[q] == ch:
                q += 1
            if q > last:  # the whole stop: only a proper prefix of it can still grow into one
                q = self._border(last)
        self.held = q

    def _border(self, j: int) -> int:
        """_fail[j], extending the table up to j first."""
        fail, stop = self._fail, self.stop
        while len(fail) <= j:
            i, k = len(fail), fail[-1]
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            fail.append(k + 1 if stop[i] == stop[k] else 0)
        return fail[j]


def context_text(tail_text: str, read_text: str) -> str:
    """The part of `read_text` (the prompt's tail and the output decoded) that is the tail's. A
    tail may end inside a character (a byte-fallback decoder writes one U+FFFD per byte of it):
    a U+FFFD the output turns into a character is the output's (the completed emoji shows), one
    still there in `read_text` is the tail's (the output did not complete it: its text is
    `decode(output_ids)`, with no U+FFFD for a prompt byte in front)."""
    end = len(tail_text.rstrip(REPLACEMENT_CHAR))
    while end < len(tail_text) and read_text[end:end + 1] == REPLACEMENT_CHAR:
        end += 1
    return tail_text[:end]


def completed_at(text: str, stop: str, before_text: str) -> int:
    """Where the first occurrence of `stop` in `text` that ends past `before_text` (the text
    without the last token) starts, or -1: the occurrence the last token completed (an earlier
    one did not end the request, so it is text). U+FFFD at the end of `before_text` are the bytes of a character the last token completes
    (an emoji or CJK character spans several byte-level tokens): they do not count as before."""
    before = len(before_text.rstrip(REPLACEMENT_CHAR))
    return text.find(stop, max(0, before - len(stop) + 1))


def decode_batch(
    tokenizer: Any,
    states: list[DecodeState],
    new_ids: list[Sequence[int]],
    finished: list[bool],
    matched: list[Matched] | None = None,
) -> list[str]:
    """Advance every state by its new tokens; return each one's delta text. `matched[i]`: the stop
    state i's request finished on (FinishReason.matched), None if none or not finished.

    All windows of states sharing decode options go through a single tokenizer.batch_decode call
    (surrogate and read windows together), which is what keeps per-step cost low for big batches.
    """
    matched = matched if matched is not None else [None] * len(states)
    if not len(states) == len(new_ids) == len(finished) == len(matched):
        raise ValueError("decode_batch: states, new_ids, finished and matched must have the same length")
    windows = [s._extend(ids, fin, m) for s, ids, fin, m in zip(states, new_ids, finished, matched)]
    texts = _decode_windows(tokenizer, states, windows)
    return [state._advance(t, fin, m) for state, t, fin, m in zip(states, texts, finished, matched)]


def _decode_windows(tokenizer: Any, states: list[DecodeState], windows: list[list[list[int]]]) -> list[list[str]]:
    """Each state's windows decoded, one batch_decode call per distinct option group."""
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, (state, own) in enumerate(zip(states, windows)):
        if own:
            groups.setdefault(state.decode_options, []).append(i)
    texts: list[list[str]] = [[] for _ in states]
    for (skip, spaces), rows in groups.items():
        decoded = iter(tokenizer.batch_decode([seq for i in rows for seq in windows[i]], skip_special_tokens=skip,
                                              spaces_between_special_tokens=spaces))
        for i in rows:
            texts[i] = [next(decoded) for _ in windows[i]]
    return texts

"""Splitting an answer into content and tool calls, whole or as a stream, for any call format.

A format (formats.py) says where a call region may start and what a region at a start holds:
still undecided (the text so far could go either way), not a call (its start is content), or
calls. A call counts from the moment its name is known to be one of the request's tools and its
arguments have begun; from then on it stays a call, however its arguments end (a call cut by
max_tokens keeps the arguments written so far, as OpenAI answers it). Whitespace between content
and a call is dropped, as SGLang's parsers strip it.

The stream parses the answer so far at each step from where it is settled (the end of the last
closed region, or of the content already sent: no later text changes either), holding back a tail
that could start a call and trailing whitespace; every split of a longer answer extends the split
of a shorter one, so the deltas concatenate to the whole-text parse at any split point. The
whole-text parse is the stream's last step.
"""
from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from tandem.runtime.text_stream import TextCursor, partial_tag_len

WS = " \t\n\r"


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text: whole, or the settled prefix while (or when cut) unfinished
    whole: bool = True


@dataclass(frozen=True)
class Region:
    """Calls found at a start; `end` is where the region stops (None: it runs on to the end)."""

    calls: tuple[Call, ...]
    end: int | None


class Pending:
    """The text at a start may still become a call or not: hold it back."""


PENDING = Pending()


class ToolFormat(Protocol):
    name: str
    start_tags: tuple[str, ...]  # what a region starts with (a held-back tail may be the start of one)
    strip_after: str  # what is dropped between a call and the content after it

    def find_start(self, text: str, pos: int) -> int:
        """The next index at or after `pos` where a region may start; -1 when none."""
        ...

    def region(self, text: str, start: int, final: bool, names: Collection[str]) -> Region | Pending | None:
        """What starts at `start`: calls, PENDING (only when not final), or None (content)."""
        ...


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[Call, ...]
    # where the next parse of a longer answer may start: past the last closed region (its content
    # and calls so far, and that a call came just before it)
    resume: tuple[int, str, tuple[Call, ...], bool] = (0, "", (), False)


class ToolParser:
    """One request's parser: its format and the names of its tools."""

    def __init__(self, fmt: ToolFormat, names: Collection[str]) -> None:
        self.fmt = fmt
        self.names = frozenset(names)

    def parse(self, text: str, final: bool = True, resume: tuple[int, str, tuple[Call, ...], bool] | None = None
              ) -> Parsed:
        pos, content, calls, after_call = resume or (0, "", (), False)
        fmt, pieces, found = self.fmt, [content], list(calls)
        search, hold_from = pos, len(text)
        while (start := fmt.find_start(text, search)) >= 0:
            region = fmt.region(text, start, final, self.names)
            if region is None:  # content: look for the next start after this one
                search = start + 1
                continue
            if isinstance(region, Pending):
                hold_from = start
                break
            pieces.append(self._piece(text[pos:start], after_call).rstrip())
            found.extend(region.calls)
            if region.end is None:  # an open region: everything after it is the call's for now
                return Parsed("".join(pieces), tuple(found), resume or (0, "", (), False))
            pos = search = region.end
            after_call = True
            resume = (pos, "".join(pieces), tuple(found), True)
        raw = text[pos:hold_from]
        tail = piece = self._piece(raw, after_call)
        if not final:
            if hold_from == len(text):
                tail = tail[:len(tail) - partial_tag_len(tail, fmt.start_tags)]
            tail = tail.rstrip()  # whitespace may precede a call
        pieces.append(tail)
        if tail:  # content no later text changes: the next parse starts after it
            resume = (pos + len(raw) - len(piece) + len(tail), "".join(pieces), tuple(found), False)
        return Parsed("".join(pieces), tuple(found), resume or (0, "", (), False))

    def _piece(self, text: str, after_call: bool) -> str:
        return text.lstrip(self.fmt.strip_after) if after_call else text


@dataclass(frozen=True)
class CallDelta:
    """A stream's news about call `index`: the first one carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)  # SGLang's and OpenAI's shape


@dataclass
class ToolStream:
    """Deltas of content and calls from a choice's cumulative answers. Each step parses from where
    the answer is settled (past the last closed region, or the content already sent); what came
    before is counted (its content length, its calls), not carried, so a step's work is the
    unsettled text's."""

    parser: ToolParser
    args: list[TextCursor] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    _pos: int = 0  # where the next parse starts
    _after_call: bool = False  # a closed region ends there
    _base: int = 0  # length of the content before _pos
    _sent: int = 0  # length of the content sent
    _closed: int = 0  # calls before _pos

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        parsed = self.parser.parse(text, final, (self._pos, "", (), self._after_call))
        delta = parsed.content[self._sent - self._base:]
        self._sent = max(self._sent, self._base + len(parsed.content))
        deltas = []
        for i, call in enumerate(parsed.calls, self._closed):
            if i == len(self.args):
                self.args.append(TextCursor())
                self.ids.append(new_call_id())
                deltas.append(CallDelta(i, self.args[i].delta(call.arguments), self.ids[i], call.name))
            elif args := self.args[i].delta(call.arguments):
                deltas.append(CallDelta(i, args))
        pos, content, calls, after_call = parsed.resume
        self._pos, self._after_call = pos, after_call
        self._base, self._closed = self._base + len(content), self._closed + len(calls)
        return delta, deltas

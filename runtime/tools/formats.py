"""The call formats of SGLang's `--tool-call-parser` names, as parser.ToolFormat regions.

- `qwen25` (also `qwen`, `hermes`): `<tool_call>{"name": .., "arguments": ..}</tool_call>`, one
  call per tag pair (Qwen2.5, Qwen3, Hermes, SmolLM3); Hermes' own order, arguments first, too.
- `llama3`: `<|python_tag|>` or a bare `{"name": .., "parameters": ..}`, calls apart by `;`.
- `mistral`: `[TOOL_CALLS]` and a JSON array of calls (or one call object).
- `deepseekv3`: `<｜tool▁calls▁begin｜>` and per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and its arguments in a ```json fence.
- `pythonic` (pythonic.py): `[f(a=1), g()]`.
- `json_array`: no parser name; what a required or named tool_choice is constrained to where the
  format has no structural tag of its own (SGLang's get_json_schema_constraint): the whole
  answer is `[{"name": .., "parameters": ..}, ...]`.

Either key, "arguments" or "parameters", is taken in every JSON format, as SGLang's parse_base_json.
"""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

import regex

from tandem.runtime.tools.json_prefix import arguments, scan
from tandem.runtime.tools.parser import PENDING, WS, Call, Pending, Region

_STRING = r'("(?:[^"\\\x00-\x1f]|\\.)*")'
_ARGS_KEY = r'"(?:arguments|parameters)"\s*:\s*'
_NAME_FIRST = regex.compile(r'\{\s*"name"\s*:\s*' + _STRING + r'\s*(?:(\})|,\s*' + _ARGS_KEY + r'(?=\{))')
_ARGS_FIRST = regex.compile(r'\{\s*' + _ARGS_KEY + r'(?=\{)')
_NAME_LAST = regex.compile(r'\s*,\s*"name"\s*:\s*' + _STRING + r'\s*\}')
_DEEPSEEK_CALL = regex.compile("<｜tool▁call▁begin｜>[^<\n]*<｜tool▁sep｜>([^\n<]+)\n```json\n(?=\\{)")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def _match(pattern: regex.Pattern, text: str, i: int, final: bool) -> regex.Match | Pending | None:
    m = pattern.match(text, i, partial=not final)
    if m is None:
        return None
    return PENDING if m.partial else m


@dataclass(frozen=True)
class Body:
    """A call object `{"name": .., "arguments": {..}}` found at an index."""

    call: Call
    end: int | None  # past the object's `}`; None while it is open
    # where what follows the call is looked for: the object's end, or where it stopped being
    # valid JSON; None while it is open and valid
    stop: int | None


def body(text: str, i: int, final: bool, names: Collection[str]) -> Body | Pending | None:
    """The call object at i, name first (a call as soon as its arguments begin) or arguments first
    (a call once the name after them is read)."""
    m = _match(_NAME_FIRST, text, i, final)
    if isinstance(m, regex.Match):
        name = json.loads(m.group(1))
        if name not in names:
            return None
        if m.group(2):  # {"name": "f"}: no arguments
            return Body(Call(name, "{}"), m.end(), m.end())
        args, whole, viable, end = arguments(text, m.end())
        if whole:
            viable, end = scan(text, i)[:2]
        else:
            end = None
        return Body(Call(name, args, whole), end, end if end is not None else (
            viable if viable < len(text) else None))
    if m is PENDING:
        return PENDING
    first = _match(_ARGS_FIRST, text, i, final)
    if not isinstance(first, regex.Match):
        return first
    args, _, viable, end = arguments(text, first.end())
    if end is None:
        return PENDING if viable == len(text) and not final else None
    last = _match(_NAME_LAST, text, end, final)
    if not isinstance(last, regex.Match):
        return last
    name = json.loads(last.group(1))
    if name not in names:
        return None
    return Body(Call(name, args), last.end(), last.end())


class TaggedFormat:
    """One call per `<tool_call>` .. `</tool_call>` pair."""

    name = "qwen25"
    begin, end_tag = "<tool_call>", "</tool_call>"
    start_tags = (begin,)
    strip_after = WS

    def find_start(self, text: str, pos: int) -> int:
        return text.find(self.begin, pos)

    def region(self, text: str, start: int, final: bool, names: Collection[str]) -> Region | Pending | None:
        i = _skip_ws(text, start + len(self.begin))
        if i == len(text):
            return None if final else PENDING
        found = body(text, i, final, names)
        if not isinstance(found, Body):
            return found
        close = -1 if found.stop is None else text.find(self.end_tag, found.stop)
        return Region((found.call,), None if close < 0 else close + len(self.end_tag))


class Llama3Format:
    name = "llama3"
    tag = "<|python_tag|>"
    start_tags = (tag, '{"name"')
    strip_after = WS + ";"  # the separator between calls

    def find_start(self, text: str, pos: int) -> int:
        hits = [k for k in (text.find(tag, pos) for tag in self.start_tags) if k >= 0]
        return min(hits, default=-1)

    def region(self, text: str, start: int, final: bool, names: Collection[str]) -> Region | Pending | None:
        i = _skip_ws(text, start + len(self.tag)) if text.startswith(self.tag, start) else start
        if i == len(text):
            return None if final else PENDING
        found = body(text, i, final, names)
        return Region((found.call,), found.stop) if isinstance(found, Body) else found


def json_list(text: str, i: int, final: bool, names: Collection[str]) -> Region | Pending | None:
    """`[call, call, ...]` from the `[` at i. Calls stay calls once found: an element that turns
    out not to be one ends the region before it."""
    calls: list[Call] = []
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return (Region(tuple(calls), None) if calls else PENDING) if not final else (
                Region(tuple(calls), i) if calls else None)
        found = body(text, i, final, names)
        if not isinstance(found, Body):
            if not calls:
                return found
            return Region(tuple(calls), None) if found is PENDING else Region(tuple(calls), i)
        calls.append(found.call)
        if found.end is None:
            return Region(tuple(calls), found.stop)
        j = _skip_ws(text, found.end)
        if j == len(text):
            return Region(tuple(calls), None if not final else j)
        if text[j] == "]":
            return Region(tuple(calls), j + 1)
        if text[j] != ",":
            return Region(tuple(calls), found.end)
        i = j + 1


class MistralFormat:
    name = "mistral"
    tag = "[TOOL_CALLS]"
    start_tags = (tag,)
    strip_after = WS

    def find_start(self, text: str, pos: int) -> int:
        return text.find(self.tag, pos)

    def region(self, text: str, start: int, final: bool, names: Collection[str]) -> Region | Pending | None:
        i = _skip_ws(text, start + len(self.tag))
        if i == len(text):
            return None if final else PENDING
        if text[i] == "[":
            return json_list(text, i, final, names)
        found = body(text, i, final, names)
        return Region((found.call,), found.stop) if isinstance(found, Body) else found


class JsonArrayFormat:
    """The whole answer is the array (it opens the answer, or it is not one)."""

    name = "json_array"
    start_tags: tuple[str, ...] = ()
    strip_after = WS

    def find_start(self, text: str, pos: int) -> int:
        i = _skip_ws(text, pos)
        return i if pos == 0 and text.startswith("[", i) else -1

    def region(self, text: str, start: int, final: bool, names: Collection[str]) -> Region | Pending | None:
        return json_list(text, start, final, names)


class DeepSeekV3Format:
    name = "deepseekv3"
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_end = "<｜tool▁call▁end｜>"
    start_tags = (begin,)
    strip_after = WS

    def find_start(self, text: str, pos: int) -> int:
        return text.find(self.begin, pos)

    def region(self, text: str, start: int, final: bool, names: Collection[str]) -> Region | Pending | None:
        calls: list[Call] = []
        i = start + len(self.begin)
        while True:
            i = _skip_ws(text, i)
            if calls and text.startswith(self.end, i):
                return Region(tuple(calls), i + len(self.end))
            m = _match(_DEEPSEEK_CALL, text, i, final)
            if m is PENDING:
                return Region(tuple(calls), None) if calls else PENDING
            if m is None or m.group(1).strip() not in names:  # type: ignore[union-attr]
                if not calls:
                    return None
                coming = not final and self.end.startswith(text[i:])  # the closing tag, partly written
                return Region(tuple(calls), None if coming else i)
            args, whole, viable, end = arguments(text, m.end())  # type: ignore[union-attr]
            calls.append(Call(m.group(1).strip(), args, whole))  # type: ignore[union-attr]
            close = -1 if end is None and viable == len(text) else text.find(
                self.call_end, end if end is not None else viable)
            if close < 0:
                return Region(tuple(calls), None)
            i = close + len(self.call_end)

"""JSON text that is still being written: how far it can still be valid, where its value ends, and
the part of a call's `arguments` string that no later text can change.

A call's `arguments` is its JSON re-serialised as SGLang writes it (`json.dumps`, ", " and ": ",
non-ASCII kept). While the call is written, the stream sends the prefix of that string that is
settled: partial-json-parser completes the text (partial strings, objects and arrays; a number or
literal only once it is whole), and the closers it had to add are cut off again. Every such prefix
is a prefix of the final string, so the deltas concatenate to it. A repeated key would break that
(the later value replaces the earlier one), so the scanner takes it as the point where the text
stops being valid; a call cut there keeps the settled prefix as its arguments (OpenAI's answer to a
call cut by max_tokens is its partial arguments too).
"""
from __future__ import annotations

import json
import re

from partial_json_parser import Allow, ensure_json

_WS = " \t\n\r"
_PARTIAL = Allow.STR | Allow.OBJ | Allow.ARR  # no partial numbers or literals: "1" may still become "12"
_CLOSERS = '"}]'
_SURROGATE = re.compile("[\ud800-\udfff]")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")


def scan(text: str, pos: int) -> tuple[int, int | None]:
    """(viable, end) for the JSON value that starts at `pos` (after any whitespace): text[:viable]
    can still be continued into valid JSON (viable == len(text) while it can), and `end` is the
    index just past the value once it is whole in the text (else None). Strict JSON: no NaN,
    no repeated key in an object."""
    stack: list[set[str] | None] = []  # per open container: its keys so far (None: an array)
    expect = "value"  # value | key | colon | after (a value done: `,` or a closer next)
    i, n = pos, len(text)
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if expect == "colon":
            if c != ":":
                return i, None
            expect, i = "value", i + 1
            continue
        if expect == "after":
            if c == ",":
                expect, i = ("key" if stack[-1] is not None else "value"), i + 1
            elif c == ("}" if stack[-1] is not None else "]"):
                stack.pop()
                i += 1
            else:
                return i, None
        elif c == '"':  # a key or a string value
            close, bad = _string_end(text, i)
            if close is None:
                return (n if bad is None else bad), None
            if expect == "key":
                key = json.loads(text[i:close])
                if key in stack[-1]:  # type: ignore[operator]
                    return i, None
                stack[-1].add(key)  # type: ignore[union-attr]
            expect, i = ("colon" if expect == "key" else "after"), close
        elif (c == "}" and expect == "key" or c == "]" and stack and stack[-1] is None) \
                and _last(text, i) in "{[":  # an empty object or array
            stack.pop()
            expect, i = "after", i + 1
        elif expect == "key":
            return i, None
        elif c in "{[":
            stack.append(set() if c == "{" else None)
            expect, i = ("key" if c == "{" else "value"), i + 1
        elif c in "-0123456789":
            if _NUMBER_PREFIX.match(text, i).end() == n:  # type: ignore[union-attr]
                return n, None  # it may still grow
            m = _NUMBER.match(text, i)
            if m is None:
                return i, None
            expect, i = "after", m.end()
        else:
            for word in ("true", "false", "null"):
                if text.startswith(word, i):
                    expect, i = "after", i + len(word)
                    break
                if word.startswith(text[i:]):
                    return n, None
            else:
                return i, None
        if expect == "after" and not stack:
            return n, i
    return n, None


def _last(text: str, i: int) -> str:
    """The last non-whitespace character before i."""
    j = i - 1
    while j >= 0 and text[j] in _WS:
        j -= 1
    return text[j] if j >= 0 else ""


def _string_end(text: str, i: int) -> tuple[int | None, int | None]:
    """(index just past the string that opens at i, None); (None, None) when the text ends inside
    it; (None, k) when it turns invalid at k (a bad escape, a raw control character)."""
    j, n = i + 1, len(text)
    while j < n:
        c = text[j]
        if c == '"':
            return j + 1, None
        if c == "\\":
            if j + 1 >= n:
                return None, None
            e = text[j + 1]
            if e == "u":
                for k in range(j + 2, min(j + 6, n)):
                    if text[k] not in _HEX:
                        return None, k
                if j + 6 > n:
                    return None, None
                j += 6
                continue
            if e not in _ESCAPES:
                return None, j + 1
            j += 2
            continue
        if c < " ":
            return None, j
        j += 1
    return None, None


def dumps(value: object) -> str:
    """SGLang's serialisation of arguments; a lone surrogate (valid in JSON text, not in UTF-8)
    stays an escape, so the answer can always be encoded."""
    text = json.dumps(value, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _SURROGATE.search(text) else text


def settled(text: str) -> str:
    """The prefix of the arguments string that `text`, a valid but unfinished JSON object, fixes."""
    try:
        value = json.loads(ensure_json(text, _PARTIAL))
    except (ValueError, RecursionError):
        return ""
    out = json.dumps(value, ensure_ascii=False).rstrip(_CLOSERS)
    if out and "\ud800" <= out[-1] <= "\udbff":  # half of a pair whose other half has not come
        out = out[:-1]
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", out) if _SURROGATE.search(out) else out


def arguments(text: str, start: int, viable: int, end: int | None) -> tuple[str, bool]:
    """(the arguments string, whether it is whole) of the object at text[start:]: whole once the
    object is; else the settled prefix of its valid part."""
    if end is not None:
        try:
            return dumps(json.loads(text[start:end])), True
        except (ValueError, RecursionError):  # deeper than json can read
            return "", False
    return settled(text[start:viable]), False

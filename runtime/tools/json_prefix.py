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

import functools
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
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
Scan = tuple[int, "int | None", int, bool]


def scan(text: str, pos: int) -> Scan:
    """(viable, end, tail, in_string) for the JSON value that starts at `pos` (after any
    whitespace): text[:viable] can still be continued into valid JSON (viable == len(text) while
    it can), `end` is the index just past the value once it is whole in the text (else None).
    While it is unfinished and valid, `tail` is where its last, unfinished token starts (a string,
    number or literal; len(text) between tokens) and `in_string` whether that token is a string
    value. Strict JSON: no NaN, no repeated key in an object."""
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
                return i, None, i, False
            expect, i = "value", i + 1
            continue
        if expect == "after":
            if c == ",":
                expect, i = ("key" if stack[-1] is not None else "value"), i + 1
            elif c == ("}" if stack[-1] is not None else "]"):
                stack.pop()
                i += 1
            else:
                return i, None, i, False
        elif c == '"':  # a key or a string value
            close, bad = _string_end(text, i)
            if close is None:
                return (n, None, i, expect == "value") if bad is None else (bad, None, bad, False)
            if expect == "key":
                key = json.loads(text[i:close])
                if key in stack[-1]:  # type: ignore[operator]
                    return i, None, i, False
                stack[-1].add(key)  # type: ignore[union-attr]
            expect, i = ("colon" if expect == "key" else "after"), close
        elif (c == "}" and expect == "key" or c == "]" and stack and stack[-1] is None) \
                and _last(text, i) in "{[":  # an empty object or array
            stack.pop()
            expect, i = "after", i + 1
        elif expect == "key":
            return i, None, i, False
        elif c in "{[":
            stack.append(set() if c == "{" else None)
            expect, i = ("key" if c == "{" else "value"), i + 1
        elif c in "-0123456789":
            if _NUMBER_PREFIX.match(text, i).end() == n:  # type: ignore[union-attr]
                return n, None, i, False  # it may still grow
            m = _NUMBER.match(text, i)
            if m is None:
                return i, None, i, False
            expect, i = "after", m.end()
        else:
            for word in ("true", "false", "null"):
                if text.startswith(word, i):
                    expect, i = "after", i + len(word)
                    break
                if word.startswith(text[i:]):
                    return n, None, i, False
            else:
                return i, None, i, False
        if expect == "after" and not stack:
            return n, i, n, False
    return n, None, n, False


def _last(text: str, i: int) -> str:
    """The last non-whitespace character before i."""
    j = i - 1
    while j >= 0 and text[j] in _WS:
        j -= 1
    return text[j] if j >= 0 else ""


def _string_end(text: str, i: int) -> tuple[int | None, int | None]:
    """(index just past the string that opens at i, None); (None, None) when the text ends inside
    it; (None, k) when it turns invalid at k (a bad escape, a raw control character)."""
    j, n = _STRING_BODY.match(text, i + 1).end(), len(text)  # type: ignore[union-attr]
    if j == n:
        return None, None
    if text[j] == '"':
        return j + 1, None
    if text[j] != "\\":
        return None, j  # a raw control character
    if j + 1 == n:
        return None, None
    if text[j + 1] != "u":
        return None, j + 1
    for k in range(j + 2, min(j + 6, n)):
        if text[k] not in _HEX:
            return None, k
    return None, None  # \u and fewer than 4 hex digits so far


def dumps(value: object) -> str:
    """SGLang's serialisation of arguments; a lone surrogate (valid in JSON text, not in UTF-8)
    stays an escape, so the answer can always be encoded."""
    text = json.dumps(value, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text) if _SURROGATE.search(text) else text


def _fix(out: str) -> str:
    """A settled prefix from a completed text's dump: the closers completion added cut off again,
    and half of a surrogate pair whose other half has not come."""
    out = out.rstrip(_CLOSERS)
    if out and "\ud800" <= out[-1] <= "\udbff":
        out = out[:-1]
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", out) if _SURROGATE.search(out) else out


@functools.lru_cache(maxsize=512)
def settled(text: str) -> str:
    """The prefix of the arguments string that `text`, a valid but unfinished JSON object, fixes.
    Cached: a stream asks again for the same prefix (its text before the token being written)
    while that token grows."""
    try:
        value = json.loads(ensure_json(text, _PARTIAL))
    except (ValueError, RecursionError):
        return ""
    return _fix(json.dumps(value, ensure_ascii=False))


def arguments(text: str, start: int) -> tuple[str, bool, int, int | None]:
    """(the arguments string, whether it is whole, viable, end) of the object at text[start:]:
    whole once the object is; else the settled prefix of its valid part (scan's viable, end).
    A string value being written is added to the settled prefix before it (cached) as it grows,
    as partial-json-parser completes it, so a long value costs its own length per step."""
    viable, end, tail, in_string = scan(text, start)
    if end is not None:
        try:
            return dumps(json.loads(text[start:end])), True, viable, end
        except (ValueError, RecursionError):  # deeper than json can read
            return "", False, viable, end
    if viable < len(text):
        return settled(text[start:viable]), False, viable, None
    if not in_string:  # the token being written is left out, as partial-json-parser leaves it
        return settled(text[start:tail]), False, viable, None
    body = text[tail + 1:_STRING_BODY.match(text, tail + 1).end()]  # type: ignore[union-attr]
    before = settled(text[start:tail] + '"')  # the value, empty so far: the text before its quote
    return _fix(before + json.dumps(json.loads(f'"{body}"'), ensure_ascii=False)), False, viable, None

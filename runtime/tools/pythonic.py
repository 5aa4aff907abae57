"""SGLang's `pythonic` calls: a Python list of calls with keyword arguments, `[f(a=1), g(b="x")]`,
optionally between Llama 4's `<|python_start|>` and `<|python_end|>`.

The list is read with `ast` and each argument with `ast.literal_eval` (literals only; nothing
is ever evaluated). It becomes calls once the list closes and reads as calls to the request's
tools (all of them at once, their arguments whole); until then it is held back, and a list that
does not read so is content.
"""
from __future__ import annotations

import ast
from collections.abc import Collection

import regex

from tandem.runtime.tools.formats import _match, _skip_ws
from tandem.runtime.tools.json_prefix import dumps
from tandem.runtime.tools.parser import PENDING, WS, Call, Pending, Region

_OPEN = regex.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_CLOSING = {")": "(", "]": "[", "}": "{"}


class PythonicFormat:
    name = "pythonic"
    py_start, py_end = "<|python_start|>", "<|python_end|>"
    start_tags = (py_start, "[")
    strip_after = WS

    def find_start(self, text: str, pos: int) -> int:
        hits = [k for k in (text.find(tag, pos) for tag in self.start_tags) if k >= 0]
        return min(hits, default=-1)

    def region(self, text: str, start: int, final: bool, names: Collection[str]) -> Region | Pending | None:
        wrapped = text.startswith(self.py_start, start)
        i = _skip_ws(text, start + len(self.py_start)) if wrapped else start
        if i == len(text):
            return None if final else PENDING
        opened = _match(_OPEN, text, i, final)
        if opened is None or isinstance(opened, Pending):
            return opened
        close = _list_end(text, i)
        if close is None:
            return None if final else PENDING
        calls = _calls(text[i:close], names) if close > 0 else None
        if calls is None:
            return None
        end = close
        if wrapped:
            j = _skip_ws(text, close)
            if text.startswith(self.py_end, j):
                end = j + len(self.py_end)
            elif not final and self.py_end.startswith(text[j:]):
                return PENDING
        return Region(calls, end)


def _list_end(text: str, i: int) -> int | None:
    """Index past the `]` that closes the list opening at i; None while the text ends inside it,
    -1 when its brackets do not match."""
    stack: list[str] = []
    quote, j, n = "", i, len(text)
    while j < n:
        c = text[j]
        if quote:
            if c == "\\":
                j += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            stack.append(c)
        elif c in _CLOSING:
            if not stack or stack.pop() != _CLOSING[c]:
                return -1
            if not stack:
                return j + 1
        j += 1
    return None


def _calls(source: str, names: Collection[str]) -> tuple[Call, ...] | None:
    """The calls `source` lists, or None when it is not a list of calls to known tools with
    literal keyword arguments."""
    try:
        tree = ast.parse(source, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
                return None
            name = ast.unparse(node.func)
            if name not in names:
                return None
            calls.append(Call(name, dumps({k.arg: ast.literal_eval(k.value) for k in node.keywords})))
        return tuple(calls)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None

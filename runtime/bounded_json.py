"""Parse untrusted JSON text with bounded nesting.

orjson before 3.9 recurses once per nesting level with no bound: a request body (or a JSON
schema string inside one) of ~50,000 nested objects overflows the C stack, and the process dies
of SIGSEGV with every request in flight. `loads` refuses text nested deeper than
`MAX_JSON_DEPTH` (the limit later orjson versions enforce) before orjson sees it, raising
orjson's own `JSONDecodeError`, so callers keep one `except`.

The depth is counted only when the text holds more brackets than the limit (a cheap
`bytes.count`), so ordinary requests pay nothing; brackets inside strings are not counted.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson

MAX_JSON_DEPTH = 1024
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_CHUNK = 1 << 20  # bytes scanned per numpy pass: bounds the temporary arrays on a 64 MB body


def loads(text: bytes | str) -> Any:
    """`orjson.loads`, or `orjson.JSONDecodeError` when `text` nests deeper than MAX_JSON_DEPTH."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    depth = nesting_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise orjson.JSONDecodeError(f"nesting deeper than {MAX_JSON_DEPTH} levels ({depth})", "", 0)
    return orjson.loads(text)


def nesting_depth(data: bytes) -> int:
    """The deepest array/object nesting of JSON text; any value <= MAX_JSON_DEPTH when the text
    has too few brackets to go deeper."""
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return 0
    bare = _STRING.sub(b"", data)
    depth = peak = 0
    for start in range(0, len(bare), _CHUNK):
        chunk = np.frombuffer(bare, np.uint8, count=min(_CHUNK, len(bare) - start), offset=start)
        opens = (chunk == ord("[")) | (chunk == ord("{"))
        closes = (chunk == ord("]")) | (chunk == ord("}"))
        running = np.cumsum(opens.astype(np.int32) - closes, dtype=np.int64) + depth
        peak = max(peak, int(running.max()))
        depth = int(running[-1])
    return peak

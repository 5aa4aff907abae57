"""bounded_json: depth is counted outside strings, and text one level too deep is refused."""
from __future__ import annotations

import orjson
import pytest

from tandem.runtime.bounded_json import MAX_JSON_DEPTH, loads, nesting_depth


def test_the_limit_itself_parses_and_one_more_level_is_refused() -> None:
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert isinstance(loads(deepest), list)  # (comparing 1024-deep lists would recurse too deep)
    with pytest.raises(orjson.JSONDecodeError, match=f"nesting deeper than {MAX_JSON_DEPTH} levels"):
        loads(b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1))


def test_brackets_inside_strings_do_not_count() -> None:
    quoted = '"' + "[{" * 5000 + '\\"[' + '"'  # an escaped quote does not end the string
    assert nesting_depth(f'{{"text": {quoted}, "ids": [[1]]}}'.encode()) == 3
    assert loads(f"[{quoted}]") == [orjson.loads(quoted)]


def test_depth_is_exact_across_scan_chunks() -> None:
    text = b"[" * 3000 + b"1" + b" " * (3 << 20) + b"]" * 3000 + b"[[[]]]"
    assert nesting_depth(text) == 3000

"""ToolStream parses each step from where the answer is settled: the text it re-reads per step
stays bounded by what it must hold back (a partial tag, trailing whitespace, an open call), so a
long answer streamed a token at a time costs O(its length), counted on the unsettled span."""
from __future__ import annotations

import pytest

from tandem.runtime.tools import FORMATS, JSON_ARRAY
from tandem.runtime.tools.parser import ToolParser, ToolStream

NAMES = ("get_weather", "search")
CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'


def _unsettled(fmt: str, text: str, step: int = 3) -> tuple[int, str]:
    """The longest span a step parsed again (text length minus where the stream's parse started),
    and the content the deltas add up to."""
    stream = ToolStream(ToolParser(JSON_ARRAY if fmt == "json_array" else FORMATS[fmt], NAMES))
    longest, content = 0, ""
    for end in range(step, len(text) + step, step):
        longest = max(longest, min(end, len(text)) - stream._pos)
        delta, _ = stream.feed(text[:end], final=end >= len(text))
        content += delta
    return longest, content


@pytest.mark.parametrize("fmt", ["qwen25", "llama3", "mistral", "json_array"])
def test_plain_content_is_read_once(fmt):
    text = "The weather is fine today, and nothing needs a tool. " * 100
    longest, content = _unsettled(fmt, text)
    whole = ToolParser(JSON_ARRAY if fmt == "json_array" else FORMATS[fmt], NAMES).parse(text)
    assert content == whole.content and not whole.calls
    assert longest <= 3 + 2  # this step's text, and the space held back before it


def test_content_around_calls_is_read_once():
    text = ("Let me look. " * 50 + CALL + "\nFound it. " * 50) * 3
    longest, content = _unsettled("qwen25", text)
    whole = ToolParser(FORMATS["qwen25"], NAMES).parse(text)
    assert content == whole.content and len(whole.calls) == 3
    assert longest <= len(CALL) + 3  # at most an open call is parsed again

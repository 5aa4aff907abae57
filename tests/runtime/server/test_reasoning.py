"""Reasoning parsers: where reasoning ends and content starts, whole and streamed."""
from __future__ import annotations

import pytest

from tandem.runtime.server.reasoning import ReasoningParser, StreamSplitter

R1, QWEN3 = ReasoningParser("deepseek-r1"), ReasoningParser("qwen3")


def test_whole_answers():
    assert R1.split("plan it\n</think>\n\nAnswer.") == ("plan it", "Answer.")
    assert R1.split("<think>plan</think>Answer") == ("plan", "Answer")
    assert R1.split("still thinking") == ("still thinking", "")  # the template opened <think>
    assert QWEN3.split("<think>\nplan\n</think>\n\nAnswer.") == ("plan", "Answer.")
    assert QWEN3.split("Answer without thinking.") == ("", "Answer without thinking.")
    assert QWEN3.split("<think>cut off") == ("cut off", "")


@pytest.mark.parametrize("parser, text", [
    (R1, "plan step one \n and two\n</think>\n\nThe answer is 4."),
    (QWEN3, "<think>\nhmm </ not yet\n</think>\n\nFour."),
    (QWEN3, "No thinking at all."),
    (R1, "never ends"),
])
def test_streamed_deltas_add_up_to_the_whole_split(parser, text):
    for step in (1, 2, 3, 7):
        splitter = StreamSplitter(parser)
        reasoning, content = "", ""
        for end in range(step, len(text) + step, step):
            r, c = splitter.feed(text[:end], final=end >= len(text))
            reasoning += r
            content += c
        assert (reasoning, content) == parser.split(text), step

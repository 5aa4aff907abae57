"""Reasoning parsers: where reasoning ends and content starts, whole and streamed."""
from __future__ import annotations

import pytest

from tandem.runtime.reasoning import ReasoningParser, StreamSplitter, with_stream_reasoning
from tandem.runtime.value_checks import ValidationError

R1 = ReasoningParser.for_request("deepseek-r1", {"enable_thinking": False})  # the template opens <think>
QWEN3 = ReasoningParser.for_request("qwen3", {"enable_thinking": False})


def test_whole_answers():
    assert R1.split("plan it\n</think>\n\nAnswer.") == ("plan it", "Answer.")
    assert R1.split("<think>plan</think>Answer") == ("plan", "Answer")
    assert R1.split("still thinking") == ("still thinking", "")  # the template opened <think>
    assert QWEN3.split("<think>\nplan\n</think>\n\nAnswer.") == ("plan", "Answer.")
    assert QWEN3.split("Answer without thinking.") == ("", "Answer without thinking.")
    assert QWEN3.split("<think>cut off") == ("cut off", "")


def test_qwen3_is_reasoning_until_the_end_tag_while_thinking_is_on():
    """Thinking is on unless enable_thinking is false (Qwen3's template: `enable_thinking is
    false` switches it off), and then the answer is reasoning up to `</think>` even when the
    template opened `<think>` itself (Qwen3 thinking-only templates), as SGLang's parser forces."""
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": None}, {"enable_thinking": "yes"}):
        thinking = ReasoningParser.for_request("qwen3", kwargs)
        assert thinking.split("step1 step2</think>\n\nThe answer") == ("step1 step2", "The answer")
        assert thinking.split("<think>plan</think>Answer") == ("plan", "Answer")
        assert thinking.split("still thinking") == ("still thinking", "")


@pytest.mark.parametrize("parser, text", [
    (R1, "plan step one \n and two\n</think>\n\nThe answer is 4."),
    (QWEN3, "<think>\nhmm </ not yet\n</think>\n\nFour."),
    (QWEN3, "No thinking at all."),
    (R1, "never ends"),
    (ReasoningParser.for_request("qwen3", {}), "<think>plan</think>Answer"),  # "<thi" is not reasoning
    (ReasoningParser.for_request("qwen3", {}), "plan</think>Answer"),
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


def _fed(splitter: StreamSplitter, texts: list[str], aborted: bool = False) -> list[tuple[str, str]]:
    return [splitter.feed(t, final=i == len(texts) - 1, aborted=aborted) for i, t in enumerate(texts)]


def test_stream_reasoning_false_sends_the_reasoning_whole_when_it_ends():
    """SGLang's stream_reasoning false: no reasoning delta while it grows; the step whose text
    closes it sends all of it as one delta (its content beside it); one that never closes sends it
    at the finish, except an abort's (SGLang flushes held reasoning only at a finish that is not one)."""
    held = with_stream_reasoning(R1, {"stream_reasoning": False})
    assert _fed(StreamSplitter(held), ["pla", "plan it\n", "plan it\n</think>\n\nAn", "plan it\n</think>\n\nAnswer"]) \
        == [("", ""), ("", ""), ("plan it", "An"), ("", "swer")]
    assert _fed(StreamSplitter(held), ["pla", "plan it", "plan it more"]) == [("", ""), ("", ""), ("plan it more", "")]
    assert _fed(StreamSplitter(held), ["pla", "plan it"], aborted=True) == [("", ""), ("", "")]
    # the default streams it as it comes, the split's deltas unchanged
    assert _fed(StreamSplitter(with_stream_reasoning(R1, {"stream_reasoning": True})), ["pla", "plan it"]) \
        == [("pla", ""), ("n it", "")]
    assert _fed(StreamSplitter(with_stream_reasoning(QWEN3, {"stream_reasoning": False})), ["No", "No think"]) \
        == [("", "No"), ("", " think")]  # no reasoning: the content streams as ever


def test_stream_reasoning_must_be_a_boolean_with_or_without_a_parser():
    assert with_stream_reasoning(None, {"stream_reasoning": False}) is None
    assert with_stream_reasoning(R1, {}) is R1
    for parser in (R1, None):
        with pytest.raises(ValidationError) as err:
            with_stream_reasoning(parser, {"stream_reasoning": "no"})
        assert err.value.field == "stream_reasoning"


@pytest.mark.parametrize("parser", ["deepseek-r1", "qwen3"])
def test_separate_reasoning_splits_a_whole_answer_as_sglangs_route(parser):
    from tandem.runtime.reasoning import separate_reasoning

    assert separate_reasoning({"text": "<think>a plan</think>The answer", "reasoning_parser": parser}) == {
        "text": "The answer", "reasoning_text": "a plan"}
    assert separate_reasoning({"text": "a plan</think> done", "reasoning_parser": parser}) == {
        "text": "done", "reasoning_text": "a plan"}  # the template opened <think>


@pytest.mark.parametrize("body, field", [
    ([], "body"), ({"reasoning_parser": "qwen3"}, "text"), ({"text": "x", "reasoning_parser": "r2"}, "reasoning_parser"),
    ({"text": "x", "reasoning_parser": "qwen3", "return_blocks": True}, "return_blocks"),
])
def test_separate_reasoning_refuses_naming_the_field(body, field):
    from tandem.runtime.reasoning import separate_reasoning
    from tandem.runtime.value_checks import ValidationError

    with pytest.raises(ValidationError) as err:
        separate_reasoning(body)
    assert err.value.field == field

"""ReasoningStream: the incremental reasoning split gives, at every step of every chunking, the
deltas the whole-text split of the answer so far gives, and holds back only a bounded tail."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.runtime.reasoning import THINK_END, ReasoningParser, ReasoningStream
from tandem.runtime.text_stream import TextCursor

PARSERS = [ReasoningParser(name, inside, streamed) for name in ("deepseek-r1", "qwen3")
           for inside in (True, False) for streamed in (True, False)]
PIECES = ["<think>", "</think>", "<", "</", "</th", "<thi", "think>", " ", "\n", "  ", "a", "bc", "x y", ">", "/"]


class WholeTextSplitter:
    """The reference: split the whole answer so far at each step, send what each part grew by."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser, self.reasoning, self.content = parser, TextCursor(), TextCursor()

    def feed(self, text: str, final: bool, aborted: bool) -> tuple[str, str]:
        reasoning, content = self.parser.split(text, final)
        if not self.parser.stream_reasoning and not (THINK_END in text or (final and not aborted)):
            reasoning = ""
        return self.reasoning.delta(reasoning), self.content.delta(content)


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    out, start = [], 0
    for p in points:
        out.append(text[start:p])
        start = p
    return out


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=14), cuts=st.lists(st.integers(0, 60), max_size=12),
       parser=st.sampled_from(PARSERS), aborted=st.booleans())
def test_every_step_equals_the_whole_text_split(pieces, cuts, parser, aborted):
    text = "".join(pieces)
    chunks = _chunks(text, cuts)
    stream, reference, so_far = ReasoningStream(parser), WholeTextSplitter(parser), ""
    for i, chunk in enumerate(chunks):
        so_far += chunk
        final = i == len(chunks) - 1
        assert stream.feed(chunk, final, aborted) == reference.feed(so_far, final, aborted), (so_far, i)


@given(text=st.text(alphabet="<>/thinkab \n", max_size=40), parser=st.sampled_from(PARSERS))
def test_one_whole_chunk_is_the_split(text, parser):
    reasoning, content = ReasoningStream(parser).feed(text, final=True)
    assert (reasoning, content) == parser.split(text)


def test_a_long_answer_is_read_once_holding_back_a_bounded_tail():
    """Streamed one character at a time, 20k characters of reasoning and content: what the stream
    keeps unsent never grows past the whitespace and partial tag it must hold, so each step's
    work is its own text's (a whole-text split would re-read the answer every step)."""
    parser = ReasoningParser("qwen3", starts_inside=True)
    text = "<think>" + "step one, then two. " * 500 + "</think>\n\n" + "the answer is four. " * 500
    stream, longest, reasoning, content = ReasoningStream(parser), 0, [], []
    for i, ch in enumerate(text):
        r, c = stream.feed(ch, final=i == len(text) - 1)
        reasoning.append(r)
        content.append(c)
        longest = max(longest, len(stream.pending))
    assert longest <= len(THINK_END)
    assert ("".join(reasoning), "".join(content)) == parser.split(text)

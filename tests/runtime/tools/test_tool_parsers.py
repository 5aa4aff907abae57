"""Tool-call parsers, process-free: fixed answers per format, and every split point of a stream
(hypothesis): the streamed content and calls equal the whole-text parse, nothing lost or sent
twice, for well-formed calls and for any text at all."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.runtime.tools import FORMATS, JSON_ARRAY
from tandem.runtime.tools.parser import ToolParser, ToolStream

NAMES = ("get_weather", "noargs", "search")
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def parser(name: str) -> ToolParser:
    return ToolParser(JSON_ARRAY if name == "json_array" else FORMATS[name], NAMES)


def streamed(p: ToolParser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed the answer cut at `cuts` (then whole, final): its content, its calls rebuilt from the
    deltas, and their ids."""
    stream, content, calls, ids = ToolStream(p), "", {}, {}
    for k in [*sorted(set(cuts)), len(text)]:
        delta, call_deltas = stream.feed(text[:k], final=k == len(text))
        content += delta
        for d in call_deltas:
            if d.id is not None:  # the first delta of a call: its id and name, once
                assert d.index not in calls and d.name is not None
                calls[d.index], ids[d.index] = [d.name, ""], d.id
            else:
                assert d.index in calls and d.name is None
            calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)], [ids[i] for i in sorted(ids)]


def assert_stream_matches(name: str, text: str, cuts: list[int]) -> None:
    p = parser(name)
    whole = p.parse(text)
    content, calls, ids = streamed(p, text, cuts)
    assert content == whole.content
    assert calls == [(c.name, c.arguments) for c in whole.calls]
    assert len(set(ids)) == len(ids)


FIXED = [
    ("qwen25", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "noargs", "arguments": {}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "days": 3}'), ("noargs", "{}")]),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
     "", [("get_weather", '{"city": "Paris"}')]),
    ("qwen25", '<tool_call>{"name": "noargs"}</tool_call> done', "done", [("noargs", "{}")]),
    ("qwen25", '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',  # not a tool: content
     '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', []),
    ("qwen25", 'a <tool_call>{"name": "get_weather", "arguments": {"city": "Pa',  # cut: the partial arguments
     "a", [("get_weather", '{"city": "Pa')]),
    ("qwen25", 'x <tool_call>{"name": "get_we', 'x <tool_call>{"name": "get_we', []),  # undecided at the end: content
    ("qwen25", '<tool_call>{"name": "search", "arguments": {"q": "a"}} junk</tool_call>after',
     "after", [("search", '{"q": "a"}')]),
    ("qwen25", '<tool_call>{"name": "search", "arguments": {"q": 1,,}}</tool_call>tail',  # malformed arguments
     "tail", [("search", '{"q": 1')]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "noargs", "parameters": {}}', "", [("get_weather", '{"city": "Paris"}'), ("noargs", "{}")]),
    ("llama3", '{"name": "search", "arguments": {"q": "x"}}', "", [("search", '{"q": "x"}')]),
    ("llama3", 'a JSON: {"key": 1}', 'a JSON: {"key": 1}', []),
    ("mistral", 'ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "noargs", "arguments": {}}]', "ok", [("get_weather", '{"city": "Paris"}'), ("noargs", "{}")]),
    ("mistral", '[TOOL_CALLS] {"name": "search", "arguments": {"q": "é"}}', "", [("search", '{"q": "é"}')]),
    ("pythonic", 'Sure [get_weather(city="Paris", days=3), noargs()]',
     "Sure", [("get_weather", '{"city": "Paris", "days": 3}'), ("noargs", "{}")]),
    ("pythonic", '<|python_start|>[search(q=[1, 2])]<|python_end|>', "", [("search", '{"q": [1, 2]}')]),
    ("pythonic", "see [1, 2] and [os.system('x')]", "see [1, 2] and [os.system('x')]", []),
    ("pythonic", "[search(q=__import__('os'))]", "[search(q=__import__('os'))]", []),  # never evaluated
    ("deepseekv3", f'x{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{DS_CALL_END}\n'
                   f'{DS_CALL}function{DS_SEP}noargs\n```json\n{{}}\n```{DS_CALL_END}{DS_END}',
     "x", [("get_weather", '{"city": "Paris"}'), ("noargs", "{}")]),
    ("json_array", '[{"name": "get_weather", "parameters": {"city": "P"}}, {"name": "noargs", "parameters": {}}]',
     "", [("get_weather", '{"city": "P"}'), ("noargs", "{}")]),
    ("json_array", 'text [{"name": "noargs", "parameters": {}}]', 'text [{"name": "noargs", "parameters": {}}]', []),
]


@pytest.mark.parametrize("name, text, content, calls", FIXED)
def test_fixed_answers(name, text, content, calls):
    whole = parser(name).parse(text)
    assert whole.content == content
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    for step in (1, 2, 5):
        assert_stream_matches(name, text, list(range(0, len(text), step)))


def test_arguments_stream_as_fragments_that_only_grow():
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "hello world", "n": 12, "tags": ["a", "b"]}}\n</tool_call>'
    stream, seen = ToolStream(parser("qwen25")), []
    for k in range(1, len(text) + 1):
        _, deltas = stream.feed(text[:k], final=k == len(text))
        seen += [d.arguments for d in deltas if d.arguments]
    assert "".join(seen) == '{"q": "hello world", "n": 12, "tags": ["a", "b"]}'
    assert len(seen) > 10  # the string value streamed as it was written, not at the end


# -- properties ---------------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8"), max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
ARGS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
CONTENT = st.lists(st.sampled_from(list("ab <[{}]>\n\"|_:,") + ["<tool", "[TOOL", "{\"name\"", "<|python"]),
                   max_size=12).map("".join)
LAYOUT = st.sampled_from([(", ", ": "), (",", ":"), (" ,  ", " : ")])


def _encode(value: object, sep: tuple[str, str], ascii_only: bool) -> str:
    return json.dumps(value, separators=sep, ensure_ascii=ascii_only)


def _call_text(fmt: str, name: str, args: dict, sep: tuple[str, str], ascii_only: bool) -> str:
    a = _encode(args, sep, ascii_only)
    if fmt == "qwen25":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {a}}}\n</tool_call>'
    if fmt == "llama3":
        return f'<|python_tag|>{{"name": "{name}", "parameters": {a}}}'
    if fmt == "mistral":
        return f'[TOOL_CALLS] [{{"name": "{name}", "arguments": {a}}}]'
    return f'{DS_BEGIN}{DS_CALL}function{DS_SEP}{name}\n```json\n{a}\n```{DS_CALL_END}{DS_END}'


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from(["qwen25", "llama3", "mistral", "deepseekv3"]), data=st.data())
def test_well_formed_calls_stream_as_the_whole_parse(fmt, data):
    calls = data.draw(st.lists(st.tuples(st.sampled_from(NAMES), ARGS), min_size=1, max_size=3))
    sep, ascii_only = data.draw(LAYOUT), data.draw(st.booleans())
    texts = [data.draw(CONTENT.filter(lambda t: not t.strip() or fmt != "llama3")) for _ in calls]
    text = "".join(t + _call_text(fmt, n, a, sep, ascii_only) for t, (n, a) in zip(texts, calls))
    whole = parser(fmt).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [(n, a) for n, a in calls]
    assert all(c.arguments == json.dumps(a, ensure_ascii=False) for c, (_, a) in zip(whole.calls, calls))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_matches(fmt, text, cuts)
    assert_stream_matches(fmt, text, list(range(len(text))))


@settings(max_examples=300, deadline=None)
@given(fmt=st.sampled_from([*FORMATS, "json_array"]), data=st.data())
def test_any_text_streams_as_the_whole_parse(fmt, data):
    """Garbled calls, cut calls, tags in content, repeated keys: whatever the text, the stream
    agrees with the whole parse."""
    pieces = st.sampled_from(['<tool_call>', '</tool_call>', '{"name": "search", "arguments": ', '{"q": ',
                              '"x"', '1', '}', '{', ',', '"q"', ' ', '\n', '[TOOL_CALLS]', '[', ']', '<|python_tag|>',
                              'search(q=1)', '(', ')', ';', DS_BEGIN, DS_CALL + "function" + DS_SEP + "search\n```json\n",
                              DS_CALL_END, DS_END, '"\\u00e9\\ud83d', '\\ude00"', '{"name": "noargs"}', 'hi'])
    text = "".join(data.draw(st.lists(pieces, max_size=14)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert_stream_matches(fmt, text, cuts)

"""The grammar a required or named call runs under, per --tool-call-parser: it compiles in the
grammar backend, accepts the calls its format's parser reads (and only those), and tandem's
tool-call form is xgrammar's own get_model_structural_tag."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from tandem.runtime.grammar.backend import GrammarBackend
from tandem.runtime.tokenizer import load_tokenizer
from tandem.runtime.tools.constraint import answer_format, constraint
from tandem.runtime.tools.parser import ToolParser
from tandem.runtime.tools.request import tool_request

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noargs"}}]
DS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n"
      "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
ANSWERS = {  # one call to get_weather, as each constraint writes it
    "qwen25": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "deepseekv3": DS,
    "pythonic": '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
    None: '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
}


@pytest.fixture(scope="module")
def backend():
    tok = load_tokenizer(None)
    b = GrammarBackend(tok, len(tok))
    yield b
    b.close()


def _grammar(kind: str, text: str) -> xgr.Grammar:
    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(text)
    tag = json.loads(text)
    if tag["type"] == "tool_calls":
        tag = xgr.get_model_structural_tag(tag["model"], tools=tag["tools"], tool_choice=tag["tool_choice"],
                                           reasoning="disabled", parallel_tool_calls=tag["parallel_tool_calls"])
        return xgr.Grammar.from_structural_tag(tag.model_dump_json())
    return xgr.Grammar.from_structural_tag(text)


@pytest.mark.parametrize("parser", list(ANSWERS))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constraints_compile_and_accept_what_their_parser_reads(backend, parser, choice):
    req = tool_request({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False})
    kind, text = constraint(req, parser)
    backend.compile(kind, text).result(timeout=60)  # the scheduler's path
    answer = ANSWERS[parser]
    grammar = _grammar(kind, text)
    assert _is_grammar_accept_string(grammar, answer)
    assert not _is_grammar_accept_string(grammar, "Hello " + answer)  # a call, from the first token
    assert not _is_grammar_accept_string(grammar, answer.replace("Paris", "1").replace('"1"', "1"))  # the schema
    parsed = ToolParser(answer_format(req, parser), req.names).parse(answer)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]


def test_auto_is_unconstrained_and_parsed_only_with_a_parser():
    req = tool_request({"tools": TOOLS})
    assert constraint(req, "qwen25") is None and answer_format(req, "qwen25") is not None
    assert answer_format(req, None) is None
    assert tool_request({"tools": TOOLS, "tool_choice": "none"}) is None

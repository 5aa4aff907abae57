"""The grammar a required or named tool call runs under, and the format its answer is parsed in
(SGLang's FunctionCallParser.get_structure_constraint, then get_json_schema_constraint).

- A parser whose format xgrammar 0.2.8 builds (`get_model_structural_tag`: qwen25/qwen/hermes as
  "qwen_3", llama3 as "llama", deepseekv3 as "deepseek_r1") gets that structural tag. It is sent
  as tandem's `{"type": "tool_calls", "model", "tools", "tool_choice", "parallel_tool_calls"}`
  form and built where it compiles (grammar/backend.py): xgrammar imports torch, which this
  process never does. Reasoning is left out of the tag: with a reasoning parser the grammar
  starts after the think end (require_reasoning), as SGLang's reasoner backend does.
- `mistral` gets a structural tag built here: `[TOOL_CALLS] [{"name": .., "arguments": ..}]`, one
  call per tag (SGLang's legacy structure for it).
- `pythonic`, and a server without a parser, get SGLang's JSON-schema fallback: the answer is a
  JSON array of `{"name", "parameters"}`, parsed as such.
An `auto` choice runs unconstrained and is parsed, as in SGLang.
"""
from __future__ import annotations

import json
from typing import Any

from tandem.runtime.tools import FORMATS, JSON_ARRAY
from tandem.runtime.tools.parser import ToolFormat
from tandem.runtime.tools.request import ToolRequest

XGRAMMAR_MODELS = {"qwen25": "qwen_3", "qwen": "qwen_3", "hermes": "qwen_3", "llama3": "llama",
                   "deepseekv3": "deepseek_r1"}


def answer_format(req: ToolRequest, parser: str | None) -> ToolFormat | None:
    """The format the answer is parsed in; None: not parsed (auto without a parser)."""
    if req.constrained and (parser is None or parser not in XGRAMMAR_MODELS and parser != "mistral"):
        return JSON_ARRAY
    return FORMATS[parser] if parser is not None else None


def constraint(req: ToolRequest, parser: str | None) -> tuple[str, str] | None:
    """(native sampling parameter, its text) for a required or named call; None for auto."""
    if not req.constrained:
        return None
    tools = req.template_tools()  # a named choice: that function alone
    if parser in XGRAMMAR_MODELS:
        choice: Any = "required" if req.named is None else {"type": "function", "function": {"name": req.named}}
        return "structural_tag", json.dumps({"type": "tool_calls", "model": XGRAMMAR_MODELS[parser], "tools": tools,
                                             "tool_choice": choice, "parallel_tool_calls": req.parallel})
    if parser == "mistral":
        tags = [{"type": "tag", "begin": '[TOOL_CALLS] [{"name": ' + json.dumps(t["function"]["name"]) + ', "arguments": ',
                 "content": {"type": "json_schema", "json_schema": _schema(t)}, "end": "}]"} for t in tools]
        fmt = {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "tags": tags, "at_least_one": True,
               "stop_after_first": not req.parallel or req.named is not None}
        return "structural_tag", json.dumps({"type": "structural_tag", "format": fmt})
    return "json_schema", json.dumps(json_array_schema(req))


def _schema(tool: dict[str, Any]) -> Any:
    """A tool's arguments schema as xgrammar reads one: none, or strict false, is any object."""
    fn = tool["function"]
    if fn.get("strict") is False or fn.get("parameters") is None:
        return {"type": "object"}
    return fn["parameters"]


def json_array_schema(req: ToolRequest) -> dict[str, Any]:
    """SGLang's get_json_schema_constraint: a non-empty array of calls, one at most without
    parallel calls (and for a named choice, whose call is that function's)."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": _schema(t)},
              "required": ["name", "parameters"]} for t in req.template_tools()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"type": "object", "anyOf": items}}
    if not req.parallel or req.named is not None:
        schema["maxItems"] = 1
    return schema

"""SGLang's /parse_function_call, which the gateway calls: {"text", "tool_call_parser", "tools"} ->
{"normal_text": the content, "calls": [{"tool_index", "name", "parameters"}]}, the text split as a
whole answer; `tool_index` is the called tool's place in `tools`, `parameters` its arguments."""
from __future__ import annotations

from typing import Any

from tandem.runtime.tools import FORMATS, TOOL_CALL_PARSERS
from tandem.runtime.tools.parser import ToolParser
from tandem.runtime.tools.request import tool_request
from tandem.runtime.value_checks import ValidationError, check_fields, short


def parse_function_call(body: Any) -> dict[str, Any]:
    check_fields(body, ("text", "tool_call_parser", "tools"), "/parse_function_call")
    if not isinstance(body.get("text"), str):
        raise ValidationError("text", "is required: a string")
    name = body.get("tool_call_parser")
    if name not in FORMATS:
        raise ValidationError("tool_call_parser", f"must be one of {', '.join(TOOL_CALL_PARSERS)}, got {short(name)}")
    tools = tool_request({"tools": body.get("tools") or []})
    names = tools.names if tools is not None else ()
    parsed = ToolParser(FORMATS[name], names).parse(body["text"])
    return {"normal_text": parsed.content,
            "calls": [{"tool_index": names.index(c.name), "name": c.name, "parameters": c.arguments}
                      for c in parsed.calls]}

"""Function tools on the Responses API (`/v1/responses`), as chat's tools.

Its tools are flat (`{"type": "function", "name", "description", "parameters", "strict"}`) and
its named choice is `{"type": "function", "name": ..}`; they become chat's nested forms, and an
error names the field as the client sent it. Input `function_call` items (consecutive ones, one
assistant turn) and `function_call_output` items become the assistant's `tool_calls` and `tool`
messages the chat template renders; an answer's calls become `function_call` output items.
"""
from __future__ import annotations

import re
import secrets
from typing import Any

import orjson

from tandem.runtime.value_checks import ValidationError, short, type_name

_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function(.*)")


def chat_tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The request's tools, tool_choice and parallel_tool_calls in chat's shapes."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ValidationError("tools", f"must be a list of tool objects, got {type_name(tools)}")
        out["tools"] = [_chat_tool(i, t) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _chat_tool(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ValidationError(f"tools[{i}]", f"must be a tool object, got {type_name(tool)}")
    if tool.get("type") != "function":  # web search, file search, MCP, ...: nothing here runs them
        raise ValidationError(f"tools[{i}].type", f"must be \"function\" (this server runs no built-in tools), "
                                                  f"got {short(tool.get('type'))}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def responses_tool_field(name: str) -> str:
    """A chat tool field in an error -> the Responses one (its function fields sit on the tool)."""
    if m := _TOOL_FIELD.match(name):
        return f"tools[{m.group(1)}]{m.group(2)}"
    return "tool_choice.name" if name == "tool_choice.function.name" else name


def input_call_messages(items: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """(input index, item) of function_call / function_call_output items -> (input index, chat
    message): consecutive calls are one assistant message."""
    out: list[tuple[int, dict]] = []
    for i, item in items:
        if item["type"] == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise ValidationError(f"input[{i}].output", f"must be a string, got {type_name(output)}")
            out.append((i, {"role": "tool", "tool_call_id": _call_id(i, item), "content": output}))
            continue
        for key in ("name", "arguments"):
            if not isinstance(item.get(key), str):
                raise ValidationError(f"input[{i}].{key}", f"is required: a string, got {type_name(item.get(key))}")
        try:  # checked here, so an error names this item (chat reads it again for the template)
            ok = isinstance(orjson.loads(item["arguments"]), dict)
        except orjson.JSONDecodeError:
            ok = False
        if not ok:
            raise ValidationError(f"input[{i}].arguments", f"must be a JSON object, got {short(item['arguments'][:50])}")
        call = {"id": _call_id(i, item), "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if out and out[-1][1].get("role") == "assistant" and out[-1][1].get("tool_calls") and \
                out[-1][1].get("content") == "":
            out[-1][1]["tool_calls"].append(call)
        else:
            out.append((i, {"role": "assistant", "content": "", "tool_calls": [call]}))
    return out


def _call_id(i: int, item: dict) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ValidationError(f"input[{i}].call_id", f"is required: a string, got {type_name(call_id)}")
    return call_id


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def new_item_id() -> str:
    return "fc_" + secrets.token_hex(12)

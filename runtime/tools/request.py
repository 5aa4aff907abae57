"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked as SGLang's protocol
and serving_chat check them; every problem is a 400 naming the field.

`tools` are function tools (`{"type": "function", "function": {"name", "description",
"parameters", "strict"}}`) with unique names, each `parameters` a valid JSON schema (Draft 2020-12,
the meta-schema check SGLang runs). `tool_choice` is "none", "auto", "required" or
`{"type": "function", "function": {"name": ..}}` naming one of them; "required" and a named
function need tools. "none" (and no tools) leaves the request a plain chat: the tools are neither
rendered nor parsed, as in SGLang.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator, SchemaError

from tandem.runtime.value_checks import ValidationError, short, type_name

CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # as the chat template and the constraint take them
    choice: str  # auto | required | named
    named: str | None = None  # the function a named choice forces
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def constrained(self) -> bool:
        """A call must come: the answer runs under a grammar (an auto one is parsed, not forced)."""
        return self.choice != "auto"

    def template_tools(self) -> list[dict[str, Any]]:
        """What the chat template renders: a named choice shows only its function, as SGLang's."""
        return [t for t in self.tools if self.named is None or t["function"]["name"] == self.named]


def tool_request(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools, or None when it asks for no call (no tools, or tool_choice "none")."""
    tools = _tools(body.get("tools"))
    choice, named = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ValidationError("parallel_tool_calls", f"must be a boolean, got {short(parallel)}")
    if not tools or choice == "none":
        return None
    return ToolRequest(tools, choice, named, parallel)


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ValidationError("tools", f"must be a list of tool objects, got {type_name(value)}")
    seen: dict[str, int] = {}
    out = []
    for i, tool in enumerate(value):
        fn = _function(f"tools[{i}]", tool)
        if fn["name"] in seen:
            raise ValidationError(f"tools[{i}].function.name", f"{short(fn['name'])} repeats tools[{seen[fn['name']]}]'s "
                                                               "name (tool names must be unique)")
        seen[fn["name"]] = i
        out.append({"type": "function", "function": fn})
    return tuple(out)


def _function(where: str, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ValidationError(where, f"must be a tool object, got {type_name(tool)}")
    if tool.get("type", "function") != "function":
        raise ValidationError(f"{where}.type", f"must be \"function\" (the only tool type here), got {short(tool['type'])}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ValidationError(f"{where}.function", "is required: an object with a name")
    where += ".function"
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValidationError(f"{where}.name", f"is required: a non-empty string, got {short(name)}")
    out: dict[str, Any] = {"name": name}
    if fn.get("description") is not None:
        if not isinstance(fn["description"], str):
            raise ValidationError(f"{where}.description", f"must be a string, got {type_name(fn['description'])}")
        out["description"] = fn["description"]
    if fn.get("parameters") is not None:
        out["parameters"] = _schema(f"{where}.parameters", fn["parameters"])
    if fn.get("strict") is not None:
        if not isinstance(fn["strict"], bool):
            raise ValidationError(f"{where}.strict", f"must be a boolean, got {short(fn['strict'])}")
        out["strict"] = fn["strict"]
    return out


def _schema(where: str, schema: Any) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise ValidationError(where, f"must be a JSON schema object, got {type_name(schema)}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        at = "".join(f"[{p!r}]" for p in exc.path)
        raise ValidationError(where, f"is not a valid JSON schema{' at ' + at if at else ''}: "
                                     f"{exc.message[:200]}") from None
    except RecursionError:
        raise ValidationError(where, "is nested too deeply to check") from None
    return schema


def _choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    if value is None:  # OpenAI's default: auto with tools, none without
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise ValidationError("tool_choice", f"must be one of {', '.join(CHOICES)} or "
                                                 f"{{\"type\": \"function\", \"function\": {{\"name\": ..}}}}, got {short(value)}")
        if value == "required" and not tools:
            raise ValidationError("tool_choice", "is \"required\" but the request has no tools")
        return value, None
    if not isinstance(value, dict):
        raise ValidationError("tool_choice", f"must be a string or an object, got {type_name(value)}")
    if value.get("type") != "function":
        raise ValidationError("tool_choice.type", f"must be \"function\", got {short(value.get('type'))}")
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValidationError("tool_choice.function.name", "is required: the name of one of the tools")
    if name not in {t["function"]["name"] for t in tools}:
        raise ValidationError("tool_choice.function.name", f"{short(name)} is not the name of any of the request's tools")
    return "named", name

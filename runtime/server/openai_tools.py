"""Tool calls on the OpenAI chat surface, as SGLang's serving_chat shapes them: the request's
sampling for a call that must come, the answer message's `tool_calls`, and a stream's tool-call
deltas (its first per call carries index, id, type and name; the rest argument fragments).

A choice that called a tool and stopped naturally finishes with "tool_calls" (a call cut by
max_tokens keeps "length", its arguments cut too, as OpenAI's); its content is null when nothing
but calls was said.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.runtime.tools.constraint import answer_format, constraint
from tandem.runtime.tools.parser import CallDelta, ToolParser, ToolStream, new_call_id
from tandem.runtime.tools.request import ToolRequest
from tandem.runtime.value_checks import ValidationError

if TYPE_CHECKING:
    from tandem.runtime.server.openai_request import OpenAIRequest

_CONSTRAINTS = ("regex", "ebnf", "json_schema", "structural_tag")


def tool_sampling(tools: ToolRequest, parser: str | None, req: OpenAIRequest) -> None:
    """A call that must come runs under its grammar (named "tools" in errors: a schema that does
    not compile is the tools' fault); special tokens stay in the text, where some formats' tags
    are (SGLang's serving_chat does both)."""
    sp = req.sampling
    req.tool_format = answer_format(tools, parser)
    if (kind_text := constraint(tools, parser)) is not None:
        for other in _CONSTRAINTS:
            if sp.get(other) is not None:
                raise ValidationError("tool_choice", f"{tools.choice} makes the answer a tool call: it cannot be "
                                                     f"combined with {req.renames.get(other, other)}")
        kind, sp[kind] = kind_text
        req.renames[kind] = "tools"
    sp.setdefault("skip_special_tokens", False)


def parser_for(req: OpenAIRequest) -> ToolParser | None:
    if req.tools is None or req.tool_format is None:
        return None
    return ToolParser(req.tool_format, req.tools.names)


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def message_calls(req: OpenAIRequest, content: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of a finished answer's message."""
    parser = parser_for(req)
    if parser is None:
        return content, None
    parsed = parser.parse(content)
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.calls]
    return parsed.content or None, calls or None


def delta_calls(deltas: list[CallDelta]) -> list[dict[str, Any]]:
    """A stream chunk's `delta.tool_calls`."""
    out = []
    for d in deltas:
        if d.id is not None:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


@dataclass
class ChoiceCalls:
    """A streamed choice's tool-call split over its content so far."""

    stream: ToolStream
    content: str = ""
    called: bool = False
    calls: list[CallDelta] = field(default_factory=list)

    def feed(self, content_delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        self.content += content_delta
        delta, calls = self.stream.feed(self.content, final)
        self.called = self.called or bool(calls)
        return delta, calls

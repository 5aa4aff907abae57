"""The OpenAI Responses API (`/v1/responses`) as SGLang serves it without storage: a request is a
chat request (`instructions` a system message before the `input` items), and its answer is a
response object with a reasoning item (with a reasoning parser), a message item and a
`function_call` item per tool call (function tools: responses_tools.py), or named stream events
numbered from 0. What needs stored responses, sessions, built-in tools or logprobs is a 400 naming
the field; nothing is stored: `store: true` (SGLang's default, under which it keeps the response
for a later previous_response_id) is answered with `store: false`, which tells the client so, and a
previous_response_id is then a 400 naming it."""
from __future__ import annotations

import re
import secrets
import time
from typing import Any, AsyncIterator, Callable

from tandem.runtime.frontend.request_groups import CallStream, ChoiceState
from tandem.runtime.server.openai import chat_request
from tandem.runtime.server.openai_request import OpenAIRequest
from tandem.runtime.server.openai_format import error_event
from tandem.runtime.reasoning import ReasoningStream
from tandem.runtime.server.openai_tools import ChoiceCalls, message_calls, parser_for
from tandem.runtime.server.responses_tools import (call_item, chat_tool_fields, input_call_messages, new_item_id,
                                                   responses_tool_field)
from tandem.runtime.tools.parser import CallDelta, ToolStream
from tandem.runtime.value_checks import ValidationError, json_text

# /v1/responses: what SGLang's ResponsesRequest takes beside input, instructions and tools, as the
# chat fields they are; what needs stored responses, built-in tools or logprobs (none here) is a 400
_RESPONSES_CHAT = ("model", "stream", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "stop", "chat_template_kwargs", "priority", "extra_key",
                   "cache_salt")
_RESPONSES_UNSUPPORTED = {
    "previous_response_id": "this server stores no responses", "conversation": "this server stores no responses",
    "background": "this server stores no responses", "prompt": "this server stores no prompt templates",
    "include": "this server returns no extra output items", "top_logprobs": "this server returns no logprobs here",
    "max_tool_calls": "this server runs no built-in tools",
    "session_id": "this server keeps no sessions"}  # as chat refuses it
_RESPONSES_DEFAULTS = {"temperature": 0.7}  # SGLang's ResponsesRequest default, under the model's own
_RESPONSES_PARTS = ("input_text", "output_text", "text")
_TEXT_FORMATS = ("text", "json_object", "json_schema")
_MESSAGE_FIELD = re.compile(r"messages\[(\d+)\](.*)")


def responses_request(body: Any, served_model: str, render: Callable[[list, dict], str],
                      reasoning_parser: str | None = None, sampling_defaults: dict[str, Any] | None = None,
                      content_format: str = "string", tool_call_parser: str | None = None,
                      template_defaults: dict[str, Any] | None = None) -> OpenAIRequest:
    """/v1/responses as SGLang serves it: `instructions` a system message before the `input`
    items, rendered and sampled as a chat request; the rid is `request_id` (SGLang's field), which
    is also the response's id. Nothing is stored (the answer says `store: false`)."""
    if not isinstance(body, dict):
        raise ValidationError("body", "must be a JSON object")
    for name, why in _RESPONSES_UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, False, 0):
            raise ValidationError(name, f"is not supported ({why})")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise ValidationError("store", f"must be a boolean, got {body['store']!r}")
    if body.get("truncation") not in (None, "disabled"):
        raise ValidationError("truncation", "must be \"disabled\" (this server never drops input)")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValidationError("instructions", "must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat = {name: body[name] for name in _RESPONSES_CHAT if body.get(name) is not None}
    messages, origin = _input_messages(body.get("input"))
    chat.update(messages=system + messages, response_format=_text_format(body),
                max_completion_tokens=body.get("max_output_tokens"),
                reasoning_effort=_only(body, "reasoning", "effort"), **chat_tool_fields(body))
    try:
        req = chat_request(chat, served_model, render, reasoning_parser,
                           {**_RESPONSES_DEFAULTS, **(sampling_defaults or {})}, content_format, tool_call_parser,
                           template_defaults)
    except ValidationError as exc:
        raise ValidationError(_responses_field(exc.field, [-1] * len(system) + origin), exc.message) from None
    req.kind = "response"
    req.renames = {**req.renames, "max_new_tokens": "max_output_tokens",  # a tool call's grammar stays the tools'
                   "json_schema": "tools" if req.renames.get("json_schema") == "tools" else "text.format"}
    req.generate.rid = body.get("request_id") or "resp_" + secrets.token_hex(16)
    req.echoed = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
                  "metadata": body.get("metadata"), "user": body.get("user"), "reasoning": body.get("reasoning"),
                  "text": body.get("text") or {"format": {"type": "text"}},
                  "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
                  "parallel_tool_calls": body.get("parallel_tool_calls", True)}
    _check_echoable(req.echoed)
    return req


def _check_echoable(echoed: dict[str, Any]) -> None:
    """The answer repeats these fields in its response object, which a stream event holds: each
    must be writable at that depth, or it is refused before any generation."""
    for name, value in echoed.items():
        json_text(name, {"response": {name: value}})


def _input_messages(value: Any) -> tuple[list[dict], list[int]]:
    """The chat messages of `input` and, for each, the input item it came from. A string is one
    user message; a list holds message items with string or text-part content, and function
    calls and their outputs."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], [0]
    if not isinstance(value, list) or not value:
        raise ValidationError("input", "must be a string or a non-empty list of message items")
    out: list[tuple[int, dict]] = []
    calls: list[tuple[int, dict]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in ("function_call", "function_call_output"):
            calls.append((i, item))
            continue
        out += input_call_messages(calls)
        calls = []
        out.append((i, _input_message(i, item, kind)))
    out += input_call_messages(calls)
    return [m for _, m in out], [i for i, _ in out]


def _input_message(i: int, item: Any, kind: Any) -> dict:
    if kind != "message":  # reasoning items, item references: nothing here keeps or reads them
        raise ValidationError(f"input[{i}].type", f"only message, function_call and function_call_output items "
                                                  f"are supported, got {kind!r}")
    content = item.get("content")
    if isinstance(content, list):
        content = [_input_part(f"input[{i}].content[{j}]", part) for j, part in enumerate(content)]
    return {"role": item.get("role"), "content": content}


def _input_part(where: str, part: Any) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _RESPONSES_PARTS:
        raise ValidationError(f"{where}.type", f"only text parts are supported, got {kind!r}")
    return {"type": "text", "text": part.get("text")}


def _only(body: dict, name: str, key: str) -> Any:
    """`body[name]`, an object of which this server honours `key` alone: that key's value. Others
    set are a 400 (text.verbosity, reasoning.summary: nothing here writes them)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValidationError(name, "must be an object")
    for other in value.keys() - {key}:
        if value[other] is not None:
            raise ValidationError(f"{name}.{other}", "is not supported by this server")
    return value.get(key)


def _text_format(body: dict) -> Any:
    """`text.format`: OpenAI's ResponseTextConfig, which SGLang's ResponsesRequest takes; it has no
    structural_tag (chat and completions' response_format has)."""
    fmt = _only(body, "text", "format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in _TEXT_FORMATS):
        raise ValidationError("text.format", "must be {\"type\": \"" + "\" | \"".join(_TEXT_FORMATS) + "\"}")
    return fmt


def _responses_field(name: str, origin: list[int]) -> str:
    """A chat field name in an error -> the /v1/responses one: a message's is its input item's
    (`origin`: each message's item; -1 the instructions)."""
    if m := _MESSAGE_FIELD.match(name):
        index, rest = origin[int(m.group(1))], m.group(2)
        return "instructions" if index < 0 else f"input[{index}]{rest}"
    name = responses_tool_field(name)
    name = name.replace("response_format.json_schema", "text.format")  # a Responses format holds its schema itself
    renames = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort"}
    head, sep, rest = name.partition(".")
    return renames[head] + sep + rest if head in renames else name


def responses_response(req: OpenAIRequest, choice: ChoiceState) -> dict[str, Any]:
    """A finished answer: a reasoning item (with a reasoning parser) and a message item, each only
    when it has text, as SGLang's _make_response_output_items, then a function_call item per call."""
    reasoning, content = req.reasoning.split(choice.text) if req.reasoning else ("", choice.text)
    output = [_reasoning_item("rs_" + secrets.token_hex(12), reasoning, "completed")] if reasoning else []
    text, calls = message_calls(req, content) if req.tools is not None else (content, None)
    if text:
        output.append(_message_item("msg_" + secrets.token_hex(12), text, "completed"))
    output += [call_item(new_item_id(), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
               for c in calls or ()]
    return _responses_object(req, int(time.time()), output, choice)


def _responses_object(req: OpenAIRequest, created: int, output: list[dict],
                      choice: ChoiceState | None) -> dict[str, Any]:
    """The response object; `choice` None: still in progress. An answer cut by max_output_tokens is
    incomplete, as OpenAI's (SGLang's says completed); an aborted one too, its reason "abort"."""
    status, incomplete, usage_ = "in_progress", None, None
    if choice is not None:
        reason = choice.finish_reason.type if choice.finish_reason is not None else None
        status = "completed" if reason == "stop" else "incomplete"
        incomplete = None if reason == "stop" else {"reason": "max_output_tokens" if reason == "length" else reason}
        usage_ = _responses_usage(choice)
    sp = req.sampling
    return {"id": req.generate.rid, "object": "response", "created_at": created, "model": req.model,
            "status": status, "error": None, "incomplete_details": incomplete, "output": output, "usage": usage_,
            "previous_response_id": None, "store": False, "temperature": sp.get("temperature"),
            "top_p": sp.get("top_p", 1.0), "tools": [], "truncation": "disabled", **req.echoed}


def _responses_usage(choice: ChoiceState) -> dict[str, Any]:
    prompt, counts = choice.prompt_tokens, choice.counters
    return {"input_tokens": prompt, "output_tokens": counts.completion_tokens,
            "total_tokens": prompt + counts.completion_tokens,
            "input_tokens_details": {"cached_tokens": counts.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": counts.reasoning_tokens}}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def responses_events(req: OpenAIRequest, updates: CallStream) -> AsyncIterator[dict]:
    """The choice's updates -> the Responses API's stream events, numbered from 0: created,
    in_progress, each output item's added / deltas / done, then completed (or incomplete). Each
    update is read once, from a cursor: O(new text) per step."""
    out = _ResponseEvents(req)
    yield out.event("response.created", response=out.snapshot(None))
    yield out.event("response.in_progress", response=out.snapshot(None))
    splitter = ReasoningStream(req.reasoning) if req.reasoning else None
    parser = parser_for(req)
    calls = ChoiceCalls(ToolStream(parser)) if parser is not None else None
    last: ChoiceState | None = None
    sent = 0
    async for c in updates:
        if updates.error is not None:  # the chat stream's error event, numbered in this stream
            yield {**error_event(req, updates.error), "type": "error", "sequence_number": out.next_number()}
            return
        last, final = c, c.finish_reason is not None
        content = c.text_from(sent)
        sent += len(content)
        reasoning = ""
        if splitter is not None:
            reasoning, content = splitter.feed(content, final=final)
        events = out.delta("reasoning", reasoning)
        if calls is not None:
            content, call_deltas = calls.feed(content, final=final)
            # a call the step goes on with comes before the step's text, a call it starts after it
            events += out.calls([d for d in call_deltas if d.id is None]) + out.delta("message", content)
            events += out.calls([d for d in call_deltas if d.id is not None])
        else:
            events += out.delta("message", content)
        for event in events:
            yield event
    for event in out.close():
        yield event
    final = out.snapshot(last)
    yield out.event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)


class _ResponseEvents:
    """A streamed response's output items: each opened as its first text comes, the one before it
    closed then; the finished items make the final response's output."""

    def __init__(self, req: OpenAIRequest) -> None:
        self.req = req
        self.created = int(time.time())
        self.number = 0
        self.output: list[dict] = []  # closed items
        self.kind: str | None = None  # the open item's: "reasoning" | "message" | "function_call"
        self.item_id = ""
        self.pieces: list[str] = []  # the open item's text so far, joined when it closes
        self.call: tuple[str, str] = ("", "")  # the open function_call item's call id and name

    def next_number(self) -> int:
        self.number += 1
        return self.number - 1

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": self.next_number(), **fields}

    def snapshot(self, choice: ChoiceState | None) -> dict[str, Any]:
        return _responses_object(self.req, self.created, list(self.output), choice)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.output), "content_index": 0}

    def _item(self, text: str | None, status: str) -> dict[str, Any]:
        build = _reasoning_item if self.kind == "reasoning" else _message_item
        return build(self.item_id, text, status)

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text} if self.kind == "reasoning" else _output_text(text)

    def delta(self, kind: str, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if kind != self.kind:
            events += self.close()
            prefix = "rs_" if kind == "reasoning" else "msg_"
            self.kind, self.item_id, self.pieces = kind, prefix + secrets.token_hex(12), []
            events += [self.event("response.output_item.added", output_index=len(self.output),
                                  item=self._item(None, "in_progress")),
                       self.event("response.content_part.added", **self._where(), part=self._part(""))]
        self.pieces.append(text)
        if kind == "reasoning":
            return events + [self.event("response.reasoning_text.delta", **self._where(), delta=text)]
        return events + [self.event("response.output_text.delta", **self._where(), delta=text, logprobs=[])]

    def calls(self, deltas: list[CallDelta]) -> list[dict]:
        """A function_call item per call: added with its name, its arguments as deltas."""
        events = []
        for d in deltas:
            if d.id is not None:
                events += self.close()
                self.kind, self.item_id, self.pieces, self.call = "function_call", new_item_id(), [], (d.id, d.name or "")
                events.append(self.event("response.output_item.added", output_index=len(self.output),
                                         item=call_item(self.item_id, *self.call, "", "in_progress")))
            if d.arguments:
                self.pieces.append(d.arguments)
                events.append(self.event("response.function_call_arguments.delta", item_id=self.item_id,
                                         output_index=len(self.output), delta=d.arguments))
        return events

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        text = "".join(self.pieces)
        if self.kind == "function_call":
            item = call_item(self.item_id, *self.call, text, "completed")
            done = [self.event("response.function_call_arguments.done", item_id=self.item_id,
                               output_index=len(self.output), arguments=text),
                    self.event("response.output_item.done", output_index=len(self.output), item=item)]
            self.output.append(item)
            self.kind = None
            return done
        if self.kind == "reasoning":
            done = [self.event("response.reasoning_text.done", **self._where(), text=text)]
        else:
            done = [self.event("response.output_text.done", **self._where(), text=text, logprobs=[])]
        item = self._item(text, "completed")
        done += [self.event("response.content_part.done", **self._where(), part=self._part(text)),
                 self.event("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        self.kind = None
        return done

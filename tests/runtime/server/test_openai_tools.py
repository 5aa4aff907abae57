"""Tool calling on the OpenAI surface, without a server: what a chat request with tools becomes
(template tools, constraint, sampling), bad tools / tool_choice named in 400s, the answer's
message and stream deltas, the Responses API's function items, /parse_function_call."""
from __future__ import annotations

import asyncio
import json

import pytest
from call_fakes import result, stream_of

from tandem.runtime.server import openai as oa
from tandem.runtime.server import openai_format as oar
from tandem.runtime.server import responses_api as ra
from tandem.runtime.tools.parse_route import parse_function_call
from tandem.runtime.value_checks import ValidationError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noargs"}}]
USER = [{"role": "user", "content": "weather?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chat(body: dict, parser: str | None = "qwen25", seen: list | None = None) -> oa.OpenAIRequest:
    def render(messages: list, kwargs: dict) -> str:
        if seen is not None:
            seen.append((messages, kwargs))
        return "<prompt>"

    return oa.chat_request({"messages": USER, **body}, "served", render, tool_call_parser=parser)


def test_tools_reach_the_template_and_a_required_call_its_grammar():
    seen: list = []
    req = _chat({"tools": TOOLS}, seen=seen)  # auto: rendered, parsed, not constrained
    assert seen[-1][1]["tools"] == TOOLS and req.tools is not None and req.tool_format is not None
    sp = req.native["sampling_params"]
    assert "structural_tag" not in sp and sp["skip_special_tokens"] is False
    req = _chat({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    tag = json.loads(req.native["sampling_params"]["structural_tag"])
    assert tag == {"type": "tool_calls", "model": "qwen_3", "tools": TOOLS, "tool_choice": "required",
                   "parallel_tool_calls": False}
    named = {"type": "function", "function": {"name": "noargs"}}
    req = _chat({"tools": TOOLS, "tool_choice": named}, seen=seen)
    assert seen[-1][1]["tools"] == TOOLS[1:]  # a named choice renders its function alone, as SGLang's
    assert json.loads(req.native["sampling_params"]["structural_tag"])["tool_choice"] == named
    # no parser, or one without a structural tag: SGLang's JSON-array schema
    for parser in (None, "pythonic"):
        schema = json.loads(_chat({"tools": TOOLS, "tool_choice": named}, parser).native["sampling_params"]["json_schema"])
        assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["noargs"]
    assert _chat({"tools": TOOLS, "tool_choice": "none"}, seen=seen).tools is None
    assert "tools" not in seen[-1][1]  # "none": neither rendered nor parsed
    assert _chat({"tools": TOOLS, "skip_special_tokens": True}).native["sampling_params"]["skip_special_tokens"]


@pytest.mark.parametrize("body, field", [
    ({"tools": "x"}, "tools"),
    ({"tools": [3]}, "tools[0]"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.type"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"tools": TOOLS, "messages": [{"role": "assistant", "content": None,
                                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tools_are_named(body, field):
    with pytest.raises(ValidationError) as err:
        _chat(body)
    assert err.value.field == field, err.value


def test_completions_still_take_no_tools():
    with pytest.raises(ValidationError) as err:
        oa.completion_request({"prompt": "a", "tools": TOOLS}, "served")
    assert err.value.field == "tools" and "/v1/chat/completions" in err.value.message


def test_a_grammar_error_names_the_tools():
    req = _chat({"tools": TOOLS, "tool_choice": "required"})
    assert req.rename(ValidationError("sampling_params.structural_tag", "does not compile: x")).field == "tools"


def test_an_answer_with_calls_is_a_tool_calls_message():
    req = _chat({"tools": TOOLS})
    stop = {"type": "stop", "matched": 2}
    out = oar.response(req, [result("Sure.\n" + CALL, 0, finish=stop), result("no call", 1, finish=stop)], 2)
    first, second = out["choices"]
    call = first["message"]["tool_calls"][0]
    assert first["finish_reason"] == "tool_calls" and first["matched_stop"] is None
    assert first["message"]["content"] == "Sure."
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert second["message"]["tool_calls"] is None and second["finish_reason"] == "stop"
    only = oar.response(req, [result(CALL, 0, finish=stop)], 1)["choices"][0]
    assert only["message"]["content"] is None  # null when only calls were said
    cut = oar.response(req, [result(CALL[:CALL.index("ris")], 0, finish={"type": "length"})], 1)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'
    bad = oar.response(req, [result('<tool_call>{"name": "nope"}</tool_call>', 0, finish=stop)], 1)["choices"][0]
    assert bad["message"]["content"] == '<tool_call>{"name": "nope"}</tool_call>' and bad["finish_reason"] == "stop"


def _collect(req, items, n=1) -> list[dict]:
    async def run():
        return [c async for c in oar.stream_chunks(req, stream_of(*items), n)]

    return asyncio.run(run())


def test_a_stream_sends_call_deltas_that_rebuild_the_calls():
    req = _chat({"tools": TOOLS, "stream": True})
    text = "Hi " + CALL + CALL.replace("Paris", "Oslo")
    steps = [result(text[:k], 0) for k in range(4, len(text), 9)] + [result(text, 0, finish={"type": "stop"})]
    chunks = _collect(req, steps)
    content, calls = "", {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                if "id" in tc:
                    assert tc["type"] == "function" and tc["index"] not in calls
                    calls[tc["index"]] = [tc["function"]["name"], ""]
                calls[tc["index"]][1] += tc["function"]["arguments"]
    assert content == "Hi"
    assert calls == {0: ["get_weather", '{"city": "Paris"}'], 1: ["get_weather", '{"city": "Oslo"}']}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_responses_take_function_tools_and_answer_function_call_items():
    body = {"input": [{"role": "user", "content": "weather?"},
                      {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "P"}'},
                      {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    seen: list = []
    req = ra.responses_request(body, "served", lambda m, kw: seen.append((m, kw)) or "<p>", tool_call_parser="qwen25")
    messages, kwargs = seen[-1]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}}]}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert kwargs["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    out = ra.responses_response(req, result(CALL, 0, finish={"type": "stop"}))
    item = out["output"][-1]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["arguments"] == '{"city": "Paris"}'
    assert item["call_id"].startswith("call_") and out["tools"] == body["tools"] and out["status"] == "completed"

    async def events():
        steps = [result(CALL[:k], 0) for k in range(5, len(CALL), 7)] + [result(CALL, 0, finish={"type": "stop"})]
        return [e async for e in ra.responses_events(req, stream_of(*steps))]

    evs = asyncio.run(events())
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    assert args == '{"city": "Paris"}'
    done = [e for e in evs if e["type"] == "response.output_item.done"][-1]["item"]
    assert done["type"] == "function_call" and done["arguments"] == args
    assert evs[-1]["response"]["output"][-1]["arguments"] == args


def test_parse_function_call_route():
    out = parse_function_call({"text": "Sure.\n" + CALL, "tool_call_parser": "qwen25", "tools": TOOLS})
    assert out == {"normal_text": "Sure.", "calls": [{"tool_index": 0, "name": "get_weather",
                                                      "parameters": '{"city": "Paris"}'}]}
    for body, field in (({"text": 1, "tool_call_parser": "qwen25"}, "text"),
                        ({"text": "x", "tool_call_parser": "kimi_k2"}, "tool_call_parser"),
                        ({"text": "x", "tool_call_parser": "qwen25", "tools": [{}]}, "tools[0].function"),
                        ({"text": "x", "tool_call_parser": "qwen25", "extra": 1}, "extra")):
        with pytest.raises(ValidationError) as err:
            parse_function_call(body)
        assert err.value.field == field


def test_a_reasoning_model_thinks_then_calls():
    """With a reasoning parser the calls are parsed from the content after the think end (and a
    required call's grammar waits for it: require_reasoning)."""
    req = oa.chat_request({"messages": USER, "tools": TOOLS, "tool_choice": "required", "stream": True}, "served",
                          lambda m, kw: "<p>", "deepseek-r1", tool_call_parser="qwen25")
    assert req.native["require_reasoning"] is True
    text = "let me look it up</think>\n\n" + CALL
    whole = oar.response(req, [result(text, 0, finish={"type": "stop"})], 1)["choices"][0]["message"]
    assert whole["reasoning_content"] == "let me look it up" and whole["content"] is None
    assert whole["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    chunks = _collect(req, [result(text[:k], 0) for k in range(3, len(text), 6)] + [
        result(text, 0, finish={"type": "stop"})])
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "let me look it up"
    assert "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls") or []) == \
        '{"city": "Paris"}'
    assert not any(d.get("content") for d in deltas)

"""/v1/responses: requests translated onto chat (fields named as the client sent them) and the
answers' response objects and stream events."""
from __future__ import annotations

import asyncio

import orjson
import pytest
from call_fakes import result, stream_of

from tandem.runtime.frontend.request_groups import CallStream
from tandem.runtime.server.openai_request import OpenAIRequest
from tandem.runtime.server.responses_api import responses_events, responses_request, responses_response
from tandem.runtime.value_checks import ValidationError


def _request(body: dict, seen: list | None = None, parser: str | None = None) -> OpenAIRequest:
    render = lambda messages, kw: (seen.append((messages, kw)) if seen is not None else None) or "<prompt>"  # noqa: E731
    return responses_request(body, "served", render, parser)


def test_responses_are_chat_requests_with_instructions_first_as_sglangs():
    """SGLang's _construct_input_messages: instructions a system message, a string input one user
    message, message items as they are (text parts joined); request_id is the rid."""
    seen: list = []
    req = _request({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}, {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"}], "instructions": "be brief", "max_output_tokens": 7, "top_p": 0.5,
        "reasoning": {"effort": "low"}, "text": {"format": {"type": "json_object"}}, "request_id": "resp_x",
        "metadata": {"k": "v"}, "store": True}, seen)
    assert seen == [([{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"},
                      {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}],
                     {"reasoning_effort": "low"})]
    assert req.kind == "response" and req.native["rid"] == "resp_x" and req.native["text"] == "<prompt>"
    assert req.native["sampling_params"] == {"temperature": 0.7, "top_p": 0.5, "max_new_tokens": 7,
                                             "json_schema": '{"type": "object"}'}  # SGLang's temperature default
    assert req.echoed["metadata"] == {"k": "v"} and req.echoed["instructions"] == "be brief"
    assert _request({"input": "x", "temperature": 0}).native["sampling_params"]["temperature"] == 0
    assert _request({"input": "x"}).native["rid"].startswith("resp_")
    assert req.rename(ValidationError("sampling_params.max_new_tokens", "max_new_tokens is 9")).field == "max_output_tokens"
    assert req.rename(ValidationError("text", "too long")).field == "input"
    assert req.rename(ValidationError("rid", "is running")).field == "request_id"


@pytest.mark.parametrize("body, field", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),  # nothing is stored
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "session_id": "s1"}, "session_id"),  # no sessions here, as chat refuses it
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),  # built-in tools: none run here
    ({"input": "x", "tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c", "output": 3}]},
     "input[1].output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input[0].arguments"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "x"}], "instructions": "i"}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, "input[0].content[0].text"),
])
def test_bad_responses_fields_are_named_as_the_client_sent_them(body, field):
    with pytest.raises(ValidationError) as err:
        _request(body)
    assert err.value.field == field




@pytest.mark.parametrize("name", ["metadata", "user"])
def test_a_repeated_field_nested_deeper_than_the_answer_can_hold_is_a_400(name):
    """The answer repeats metadata and user inside its response object, inside a stream event:
    nested 260 deep (the body parser takes 1024) it was accepted, generated, and then the answer
    could not be written, a 500 (a stream cut off at its first event)."""
    deep: object = "v"
    for _ in range(260):
        deep = {"k": deep}
    with pytest.raises(ValidationError) as err:
        _request({"input": "x", name: deep})
    assert err.value.field == name and "cannot be encoded as JSON" in err.value.message
    ok = _request({"input": "x", name: {"k": {"k": "v"}}})
    events = _events(ok, stream_of(result("ab", 0, finish={"type": "stop"})))
    assert orjson.dumps(events) and events[-1]["response"][name] == {"k": {"k": "v"}}


def test_store_true_is_answered_store_false():
    """SGLang's default store true keeps a response for a later previous_response_id; nothing is
    stored here, and the answer says so (store false) rather than the request being refused: a
    previous_response_id is the 400, naming itself."""
    for store in (True, False, None):
        out = responses_response(_request({"input": "x", "store": store}), result("ab", 0, finish={"type": "stop"}))
        assert out["store"] is False and out["status"] == "completed"


def _events(req: OpenAIRequest, stream: CallStream) -> list[dict]:
    async def collect():
        return [e async for e in responses_events(req, stream)]

    return asyncio.run(collect())


def test_a_response_holds_its_reasoning_and_message_items_and_responses_usage():
    req = _request({"input": "x", "max_output_tokens": 2, "metadata": {"k": 1}}, parser="deepseek-r1")
    answer = result("ab</think>cd", 0, finish={"type": "stop", "matched": 2})
    answer["meta_info"]["reasoning_tokens"] = 0  # the scheduler's count (SGLang's), 3 below
    out = responses_response(req, answer)
    assert out["id"] == req.native["rid"] and out["object"] == "response" and out["status"] == "completed"
    assert [(i["type"], i["status"]) for i in out["output"]] == [("reasoning", "completed"), ("message", "completed")]
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "ab"}]
    assert out["output"][1]["content"][0]["text"] == "cd" and out["output"][1]["role"] == "assistant"
    assert out["usage"] == {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7, "output_tokens_details":
                            {"reasoning_tokens": 0}, "input_tokens_details": {"cached_tokens": 1, "cache_write_tokens": 0}}
    assert (out["metadata"], out["max_output_tokens"], out["store"], out["temperature"]) == ({"k": 1}, 2, False, 0.7)
    answer["meta_info"]["reasoning_tokens"] = 3
    assert responses_response(req, answer)["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    cut = responses_response(_request({"input": "x"}), result("ab", 0, finish={"type": "length"}))
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [i["type"] for i in cut["output"]] == ["message"]  # no reasoning parser: all of it is the message


def test_a_streamed_response_numbers_its_events_and_closes_each_item_in_order():
    req = _request({"input": "x", "stream": True}, parser="deepseek-r1")
    events = _events(req, stream_of(result("a", 0, completion=1), result("ab</think>c", 0, completion=2),
                                  result("ab</think>cd", 0, completion=3, finish={"type": "stop", "matched": 2})))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["a", "b", "c", "d"]
    message = [e for e in events if e["type"] == "response.output_item.done"][1]
    assert message["output_index"] == 1 and message["item"]["content"][0]["text"] == "cd"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][1] == message["item"]
    assert final["id"] == events[0]["response"]["id"] == req.native["rid"] and events[0]["response"]["output"] == []


def test_a_streamed_response_that_fails_ends_with_an_error_event_naming_the_field():
    req = _request({"input": "x", "stream": True, "text": {"format": {"type": "json_object"}}})
    abort = {"type": "abort", "message": "x", "status_code": 400}
    events = _events(req, stream_of(result("a", 0, completion=1), result("a", 0, completion=1, finish=abort),
                                  error=ValidationError("sampling_params.json_schema", "does not compile: x")))
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1]["sequence_number"] == len(events) - 1
    assert events[-1]["error"] == {"message": "text.format does not compile: x", "type": "BadRequestError",
                                   "param": "text.format", "code": 400}
    cut = _events(_request({"input": "x", "stream": True}), stream_of(result("ab", 0, finish={"type": "length"})))
    assert cut[-1]["type"] == "response.incomplete" and cut[-1]["response"]["status"] == "incomplete"

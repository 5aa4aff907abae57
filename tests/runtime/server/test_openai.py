"""OpenAI requests -> native /generate bodies, without a server."""
from __future__ import annotations

import pytest

from tandem.runtime.server import openai as oa
from tandem.runtime.tokenizer import template_content_format
from tandem.runtime.value_checks import ValidationError


def _completion(body: dict) -> oa.OpenAIRequest:
    req = oa.completion_request(body, "served")
    oa.decode_echo(req, _IdTokenizer())
    return req


class _IdTokenizer:
    """Each id as `<id>`; id 0 plays a special token."""

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(f"<{i}>" for i in ids if not skip_special_tokens or i)


def test_echoed_token_ids_are_decoded_only_after_validation():
    """The tokenizer raises on ids that are not token ids (-5, 2.5, 2**70): a bad echoed prompt
    must reach the server's validation (a 400 naming prompt[i][j]) before any decode."""
    req = oa.completion_request({"prompt": [[1, -5], [2.5]], "echo": True}, "served")
    assert req.native["input_ids"] == [[1, -5], [2.5]] and req.echo_ids == [[1, -5], [2.5]] and not req.echo_texts
    assert oa.completion_request({"prompt": [7, 8], "echo": True}, "served").echo_ids == [[7, 8]]
    assert oa.completion_request({"prompt": [7, 8]}, "served").echo_ids == []


def _chat(body: dict) -> oa.OpenAIRequest:
    return oa.chat_request(body, "served", lambda messages, kw: f"{len(messages)} messages {kw}")


def test_completion_fields_map_onto_generate():
    req = _completion({"prompt": "hi", "temperature": 0.5, "seed": 3, "stop": "x", "min_tokens": 2, "logprobs": 2,
                       "response_format": {"type": "json_object"}, "user": "ignored", "unknown_field": 1,
                       "stop_regex": "y+"})
    assert req.native == {"text": "hi", "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
                          "sampling_params": {"temperature": 0.5, "seed": 3, "stop": "x", "min_new_tokens": 2,
                                              "stop_regex": "y+",
                                              "max_new_tokens": 16, "json_schema": '{"type": "object"}'}}
    assert req.model == "served" and req.logprobs
    assert _completion({"prompt": [[1, 2], [3]], "echo": True}).echo_texts == ["<1><2>", "<3>"]
    # id 0 plays a special token: skipped in the echo, kept when the prompt's logprobs must join into it
    assert _completion({"prompt": [0, 1], "echo": True}).echo_texts == ["<1>"]
    assert _completion({"prompt": [0, 1], "echo": True, "logprobs": 0}).echo_texts == ["<0><1>"]
    assert _completion({"prompt": [5, 6], "max_tokens": 3}).native["input_ids"] == [5, 6]
    both = _completion({"prompt": "a", "max_tokens": 3, "max_completion_tokens": 4})
    assert both.native["sampling_params"]["max_new_tokens"] == 4 and both.renames["max_new_tokens"] == "max_completion_tokens"


def test_chat_fields_map_onto_generate():
    req = _chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3,
                 "chat_template_kwargs": {"enable_thinking": False}, "stream": True,
                 "stream_options": {"include_usage": True},
                 "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array"}}}})
    assert req.native["text"] == "1 messages {'enable_thinking': False}"
    assert req.native["top_logprobs_num"] == 3 and req.stream and req.include_usage and req.native["stream"]
    # chat without max_tokens: null, as many tokens as fit (SGLang's chat); completions default to 16
    assert req.native["sampling_params"] == {"json_schema": '{"type":"array"}', "max_new_tokens": None}


def test_chat_takes_the_models_sampling_defaults_for_fields_it_leaves_out():
    messages = [{"role": "user", "content": "x"}]
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.9}
    req = oa.chat_request({"messages": messages, "top_p": 0.5, "temperature": 0}, "served",
                          lambda m, k: "t", sampling_defaults=defaults)
    assert req.native["sampling_params"] == {"temperature": 0, "top_p": 0.5, "top_k": 20, "max_new_tokens": None}
    assert _chat({"messages": messages}).native["sampling_params"] == {"max_new_tokens": None}


def test_text_content_parts_are_joined_for_the_template():
    """By spaces, as SGLang's process_content_for_template_format for string-content templates."""
    seen = []
    oa.chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]},
                    "served", lambda messages, kw: seen.append(messages) or "x")
    assert seen == [[{"role": "user", "content": "a b"}]]


def test_require_reasoning_defaults_on_for_constrained_chat_on_a_reasoning_server():
    msgs = [{"role": "user", "content": "x"}]
    fmt = {"response_format": {"type": "json_object"}}

    def native(body: dict, parser: str | None) -> dict:
        return oa.chat_request({"messages": msgs, **body}, "served", lambda m, kw: "t", parser).native

    assert native(fmt, "deepseek-r1")["require_reasoning"] is True
    assert native(fmt, "qwen3")["require_reasoning"] is True
    assert native({**fmt, "chat_template_kwargs": {"enable_thinking": False}}, "qwen3")["require_reasoning"] is False
    assert native({**fmt, "require_reasoning": False}, "deepseek-r1")["require_reasoning"] is False  # explicit wins
    assert "require_reasoning" not in native(fmt, None)  # no parser: the grammar holds from the start
    assert native({}, "deepseek-r1")["require_reasoning"] is True  # SGLang: every chat reasons first
    assert _completion({"prompt": "a", "regex": "b", "require_reasoning": True}).native["require_reasoning"] is True


@pytest.mark.parametrize("body, field", [
    ({"prompt": None}, "prompt"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "tools": [{"type": "function"}]}, "tools"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema.schema"),
    # SGLang's "schema_ is required": no schema is not "any JSON"
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"prompt": "a", "tool_choice": "required"}, "tool_choice"),
    ({"prompt": "a", "tools": [{"type": "function"}], "tool_choice": "auto"}, "tools"),
    ({"prompt": "a", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_completion_fields(body, field):
    with pytest.raises(ValidationError) as err:
        _completion(body)
    assert err.value.field == field


@pytest.mark.parametrize("body, field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),  # SGLang's user message requires it
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 0}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": 1}, "stream_options"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
])
def test_bad_chat_fields(body, field):
    with pytest.raises(ValidationError) as err:
        _chat(body)
    assert err.value.field == field


def test_best_of_that_would_pick_among_candidates_is_refused_not_ignored():
    """OpenAI's best_of > n answers with the n most likely of best_of candidates; this server does
    not rank candidates, so such a request is a 400 naming best_of rather than n unranked choices
    (SGLang's silent answer). best_of equal to n picks nothing and passes."""
    for body in ({"prompt": "a", "best_of": 3}, {"prompt": "a", "best_of": 3, "n": 2},
                 {"prompt": "a", "best_of": 1, "n": 2}, {"prompt": "a", "best_of": 0}, {"prompt": "a", "best_of": "2"}):
        with pytest.raises(ValidationError) as err:
            _completion(body)
        assert err.value.field == "best_of", body
    assert _completion({"prompt": "a", "best_of": 2, "n": 2}).native["sampling_params"]["n"] == 2
    assert "n" not in _completion({"prompt": "a", "best_of": 1}).native["sampling_params"]


def test_custom_params_reach_generate_as_in_sglang():
    # SGLang's protocol takes them into sampling_params; with no logit processor they change nothing
    for make, prompt in ((_chat, {"messages": [{"role": "user", "content": "x"}]}), (_completion, {"prompt": "a"})):
        assert make({**prompt, "custom_params": {"k": 1}}).native["sampling_params"]["custom_params"] == {"k": 1}


@pytest.mark.parametrize("field", ["lora_path", "custom_logit_processor", "return_hidden_states",
                                   "reasoning", "session_params", "return_token_ids", "return_meta_info"])
def test_sglang_extensions_this_server_lacks_are_refused_not_ignored(field):
    for make, prompt in ((_chat, {"messages": [{"role": "user", "content": "x"}]}), (_completion, {"prompt": "a"})):
        with pytest.raises(ValidationError) as err:
            make({**prompt, field: "x"})
        assert err.value.field == field and "not supported" in err.value.message


def test_reasoning_effort_goes_to_the_chat_template_as_sglangs():
    seen: list = []
    render = lambda m, kw: seen.append(kw) or "<prompt>"  # noqa: E731
    oa.chat_request({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high",
                     "chat_template_kwargs": {"enable_thinking": True}}, "served", render)
    assert seen == [{"reasoning_effort": "high", "enable_thinking": True}]
    with pytest.raises(ValidationError) as err:
        _chat({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"})
    assert err.value.field == "reasoning_effort"
    # every tier of SGLang's protocol passes; "none" switches thinking off unless the kwargs say otherwise
    for bad in (1.5, True, -0.1):
        with pytest.raises(ValidationError, match="reasoning_effort"):
            _chat({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": bad})
    for effort in ("minimal", "xhigh", "max", 0.5, 0):
        oa.chat_request({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": effort}, "served", render)
        assert seen.pop() == {"reasoning_effort": effort}
    oa.chat_request({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none",
                     "chat_template_kwargs": {"thinking": True}}, "served", render)
    assert seen.pop() == {"reasoning_effort": "none", "thinking": True, "enable_thinking": False}
    with pytest.raises(ValidationError) as err:  # completions render no template: refused, not ignored
        _completion({"prompt": "a", "reasoning_effort": "low"})
    assert err.value.field == "reasoning_effort" and "not supported" in err.value.message


def test_sglang_extensions_sent_as_their_off_values_pass():
    off = {"return_hidden_states": False, "continue_final_message": False, "lora_path": "", "tools": []}
    assert _chat({"messages": [{"role": "user", "content": "x"}], **off}).native["text"]
    # what asks for no tool call, as SGLang ignores it
    tools = [{"type": "function", "function": {"name": "f"}}]
    for no_call in ({"tools": tools, "tool_choice": "none"}, {"tool_choice": "auto"}, {"parallel_tool_calls": True}):
        assert _chat({"messages": [{"role": "user", "content": "x"}], **no_call}).native["text"]


def test_messages_are_normalized_as_sglang_renders_them():
    """Roles lowercased; a null content is empty; a final assistant message is rendered as the
    user's (SGLang's _handle_last_assistant_message), or continued with continue_final_message."""
    seen: list = []

    def chat(messages: list, **body) -> str:
        return oa.chat_request({"messages": messages, **body}, "served",
                               lambda m, kw: seen.append(m) or "<prompt>").native["text"]

    assert chat([{"role": "User", "content": "x"}, {"role": "assistant", "content": None},
                 {"role": "user", "content": "y"}]) == "<prompt>"
    assert seen.pop() == [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""},
                          {"role": "user", "content": "y"}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    assert chat(history) == "<prompt>"
    assert seen.pop() == [{"role": "user", "content": "hi"}, {"role": "user", "content": "Hello"}]
    assert chat(history, continue_final_message=True) == "<prompt>Hello"
    assert seen.pop() == [{"role": "user", "content": "hi"}]


def test_chat_input_ids_are_the_prompt_without_the_template():
    req = _chat({"messages": [{"role": "user", "content": "x"}], "input_ids": [1, 2, 3]})
    assert req.native["input_ids"] == [1, 2, 3] and "text" not in req.native


def test_response_format_json_schema_at_the_top_level():
    fmt = {"type": "json_schema", "schema": {"type": "array"}}
    assert _completion({"prompt": "a", "response_format": fmt}).native["sampling_params"]["json_schema"] \
        == '{"type":"array"}'


def test_chat_input_ids_errors_name_input_ids():
    req = _chat({"messages": [{"role": "user", "content": "x"}], "input_ids": [1, -5]})
    assert req.rename(ValidationError("input_ids[1]", "bad")).field == "input_ids[1]"
    assert _chat({"messages": [{"role": "user", "content": "x"}]}).rename(
        ValidationError("text", "bad")).field == "messages"


def test_rid_priority_and_extra_key_reach_generate():
    fields = {"rid": "mine", "priority": 3, "extra_key": "tenant", "cache_salt": "s"}
    assert {k: _chat({"messages": [{"role": "user", "content": "x"}], **fields}).native[k] for k in fields} == fields
    assert {k: _completion({"prompt": "a", **fields}).native[k] for k in fields} == fields


def test_native_field_names_in_errors_become_openai_ones():
    req = _chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5})
    assert req.rename(ValidationError("sampling_params.max_new_tokens", "too big")).field == "max_completion_tokens"
    min_tokens = req.rename(ValidationError("sampling_params.min_new_tokens", "must be <= max_new_tokens (5), got 8"))
    assert str(min_tokens) == "min_tokens must be <= max_completion_tokens (5), got 8"
    assert req.rename(ValidationError("sampling_params.sampling_seed", "bad")).field == "seed"
    assert req.rename(ValidationError("sampling_params[1].temperature", "bad")).field == "temperature"
    assert req.rename(ValidationError("text", "too long")).field == "messages"
    assert _completion({"prompt": "a"}).rename(ValidationError("input_ids[0]", "bad")).field == "prompt[0]"
    # guided fields: the top-level name, or response_format when that set the schema
    assert req.rename(ValidationError("sampling_params.regex", "does not compile")).field == "regex"
    assert req.rename(ValidationError("sampling_params.json_schema", "bad")).field == "json_schema"
    fmt = _chat({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})
    assert fmt.rename(ValidationError("sampling_params.json_schema", "bad")).field == "response_format"


# a template that renders earlier tool calls with `| tojson` and loops over content parts, as
# Qwen2.5's and Llama 3's do
_TOOL_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}:"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}{{ part.text }}{% endfor %}{% endif %}"
    "{% for call in message.tool_calls or [] %}{{ call.function.arguments | tojson }}{% endfor %}|"
    "{% endfor %}"
)


def _jinja(messages: list, kw: dict) -> str:
    import jinja2

    return jinja2.Environment().from_string(_TOOL_TEMPLATE).render(messages=messages, **kw)


def test_tool_call_arguments_reach_the_template_as_an_object_as_sglangs():
    """SGLang's normalize_assistant_tool_call_arguments: the JSON string OpenAI clients send is
    parsed, so `| tojson` writes the object once, not a quoted string; a bad one is a 400."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "w?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "22C"}]
    text = oa.chat_request({"messages": history}, "served", _jinja).native["text"]
    assert text == 'user:w?|assistant:{"city": "Paris"}|tool:22C|'
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000  # orjson 3.8 recursed into it and the process died (SIGSEGV)
    for args, problem in (("{not json", "valid JSON"), ("[1]", "a JSON object"), (deep, "valid JSON")):
        bad = {**call, "function": {"name": "f", "arguments": args}}
        with pytest.raises(ValidationError) as err:
            _chat({"messages": [history[0], {**history[1], "tool_calls": [bad]}]})
        assert err.value.field == "messages[1].tool_calls[0].function.arguments" and problem in err.value.message
    with pytest.raises(ValidationError) as err:
        _chat({"messages": [history[0], {**history[1], "tool_calls": [{"id": "c1"}]}]})
    assert err.value.field == "messages[1].tool_calls[0].function"


def test_content_parts_stay_a_list_for_a_template_that_loops_over_them():
    """SGLang's process_content_for_template_format: a template that loops over message.content
    gets the parts ("openai"); one that takes a string gets them joined by spaces ("string"), as a
    tool result always is."""
    assert template_content_format(_TOOL_TEMPLATE) == "openai"
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    messages = [{"role": "user", "content": parts}, {"role": "tool", "content": parts}]
    chat = lambda fmt: oa.chat_request({"messages": messages}, "served", _jinja,  # noqa: E731
                                       content_format=fmt).native["text"]
    assert chat("openai") == "user:Helloworld|tool:Hello world|"
    assert chat("string") == "user:Hello world|tool:Hello world|"
    # a final assistant turn given as parts is neither a prefix nor turned into the user's, as SGLang's
    last = oa.chat_request({"messages": [messages[0], {"role": "assistant", "content": parts}],
                            "continue_final_message": True}, "served", _jinja, content_format="openai")
    assert last.native["text"] == "user:Helloworld|assistant:Helloworld|"


@pytest.mark.parametrize("key", ["add_generation_prompt", "tokenize", "continue_final_message", "chat_template"])
def test_chat_template_kwargs_cannot_set_the_renderers_own_arguments(key):
    with pytest.raises(ValidationError) as err:
        _chat({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {key: True}})
    assert err.value.field == f"chat_template_kwargs.{key}"

def test_a_constraint_clash_names_response_format_as_the_client_sent_it():
    """`regex` with `response_format` json_object: the clash is a 400 naming both fields the client
    sent; the message said "json_schema", a field this client never used."""
    req = _completion({"prompt": "a", "response_format": {"type": "json_object"}})
    exc = req.rename(ValidationError("sampling_params.regex",
                                     "cannot be combined with json_schema; give one constraint"))
    assert (exc.field, exc.message) == ("regex", "cannot be combined with response_format; give one constraint")


def test_a_dp_rank_in_the_body_reaches_generates_check():
    # it was dropped on the OpenAI routes (a 200 for rank 3) while /generate refuses it, as SGLang
    for build, body in ((_completion, {"prompt": "hi"}), (_chat, {"messages": [{"role": "user", "content": "hi"}]})):
        for name in ("routed_dp_rank", "data_parallel_rank"):
            assert build({**body, name: 3}).native[name] == 3


def test_a_lora_adapter_in_the_model_name_is_refused():
    # SGLang reads "base:adapter" as a LoRA adapter; with none here the base model answered it
    for build, body in ((_completion, {"prompt": "hi"}), (_chat, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(ValidationError, match="^model names the LoRA adapter 'sql'"):
            build({**body, "model": "served:sql"})
        assert build({**body, "model": "other-name"}).model == "other-name"  # a plain name is only echoed
    assert oa.completion_request({"prompt": "hi", "model": "org/m:v2"}, "org/m:v2").model == "org/m:v2"


def test_include_stop_str_in_output_keeps_the_stop_string_as_no_stop_trim() -> None:
    """vLLM's include_stop_str_in_output: SGLang's protocol drops it unread, so a client asking for
    the stop string got it trimmed; here it is no_stop_trim, which an explicit no_stop_trim overrides."""
    sp = _completion({"prompt": "Hi", "stop": ["."], "include_stop_str_in_output": True}).native["sampling_params"]
    assert sp["no_stop_trim"] is True
    sp = _completion({"prompt": "Hi", "include_stop_str_in_output": False}).native["sampling_params"]
    assert "no_stop_trim" not in sp
    req = oa.chat_request({"messages": [{"role": "user", "content": "Hi"}], "include_stop_str_in_output": True,
                           "no_stop_trim": False}, "served", lambda messages, kwargs: "Hi")
    assert req.native["sampling_params"]["no_stop_trim"] is False
    with pytest.raises(ValidationError, match="include_stop_str_in_output"):
        _completion({"prompt": "Hi", "include_stop_str_in_output": "yes"})


def test_default_chat_template_kwargs_apply_under_the_requests_own():
    """--default-chat-template-kwargs: every chat gets them (and the qwen3 reasoning split follows
    them), a request's own chat_template_kwargs win key by key."""
    seen: list = []
    render = lambda m, kw: seen.append(kw) or "<prompt>"  # noqa: E731
    defaults = {"enable_thinking": False, "custom": 1}
    off = oa.chat_request({"messages": [{"role": "user", "content": "x"}]}, "served", render, "qwen3",
                          template_defaults=defaults)
    assert seen.pop() == defaults and off.reasoning is not None and not off.reasoning.starts_inside
    on = oa.chat_request({"messages": [{"role": "user", "content": "x"}],
                          "chat_template_kwargs": {"enable_thinking": True}}, "served", render, "qwen3",
                         template_defaults=defaults)
    assert seen.pop() == {"enable_thinking": True, "custom": 1} and on.reasoning.starts_inside


@pytest.mark.parametrize("text", ["not json", "[1, 2]"])
def test_default_chat_template_kwargs_must_be_a_json_object(text):
    from tandem.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="^--default-chat-template-kwargs"):
        ServerArgs(default_chat_template_kwargs=text)
    assert ServerArgs(default_chat_template_kwargs='{"a": 1}').chat_template_defaults == {"a": 1}

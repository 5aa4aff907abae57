"""The OpenAI API (`/v1/completions`, `/v1/chat/completions`): its requests, each filled into
the typed GenerateRequest the tokenizer manager takes (the answers' shapes, rendered from the
choices: openai_format; `/v1/responses`, a chat request: responses_api).

The GenerateRequest is validated exactly as a `/generate` body with the same fields; a native
field name in an error is mapped back to the OpenAI one.
Unknown fields are ignored, as OpenAI-compatible servers do; known fields this server cannot
honour (OpenAI's audio, ...; SGLang's extensions lora_path, session_params, ...) are a 400
rather than a silently different answer. SGLang's rid, priority and extra_key pass through.
Chat takes `tools` (runtime/tools/): rendered by the chat template, a required or named call
constrained, the answer's calls parsed in the server's --tool-call-parser format.
"""
from __future__ import annotations

from typing import Any, Callable

import orjson

from tandem.runtime.frontend.generate_request import GenerateRequest
from tandem.runtime.server.openai_request import OpenAIRequest
from tandem.runtime.server.openai_vllm import apply_vllm_fields
from tandem.runtime.server.openai_response_format import response_format_constraint
from tandem.runtime.reasoning import ReasoningParser
from tandem.runtime.server.openai_tools import tool_sampling
from tandem.runtime.tools.request import tool_request
from tandem.runtime.value_checks import ValidationError, is_int

# OpenAI name -> native sampling_params name (None: the same name)
_SAMPLING = {
    "temperature": None, "top_p": None, "top_k": None, "min_p": None, "n": None, "stop": None, "seed": None,
    "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None, "logit_bias": None,
    "ignore_eos": None, "skip_special_tokens": None, "spaces_between_special_tokens": None, "no_stop_trim": None,
    "stop_token_ids": None, "min_tokens": "min_new_tokens", "regex": None, "ebnf": None, "json_schema": None,
    "max_thinking_tokens": None, "stop_regex": None,
    # only a custom logit processor reads them (this server has none): /generate takes and drops them, as SGLang
    "custom_params": None,
}
_CONSTRAINTS = ("regex", "ebnf", "json_schema")
# known OpenAI fields whose meaning this server does not implement: a 400, never ignored
# (tools and tool_choice on /v1/completions: see _check_tools)
_UNSUPPORTED = ("functions", "function_call", "audio", "modalities", "prediction", "suffix",
                "web_search_options", "reasoning",
                # SGLang's extensions of the OpenAI API that this server does not implement
                "lora_path", "custom_logit_processor", "return_hidden_states",
                "return_routed_experts", "session_params", "session_id", "return_token_ids",
                "return_prompt_token_ids", "return_meta_info", "return_cached_tokens_details")
# apply_chat_template's own arguments, which the server sets when it renders a chat
_RENDER_ARGS = frozenset(("tokenize", "add_generation_prompt", "chat_template", "continue_final_message"))
# OpenAI's reasoning effort tiers, as SGLang's protocol accepts them
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# the roles SGLang's protocol accepts (after lowercasing)
_ROLES = ("system", "user", "assistant", "tool", "function", "developer", "latest_reminder")
_NATIVE_TOP = ("rid", "priority", "extra_key", "cache_salt",  # SGLang's extensions /generate takes as they are
               "routed_dp_rank", "data_parallel_rank")


# -- requests ---------------------------------------------------------------------------------------------
def completion_request(body: Any, served_model: str) -> OpenAIRequest:
    _check_object(body)
    _check_tools(body)
    prompt = body.get("prompt")
    echo = _flag(body, "echo")
    if body.get("reasoning_effort") is not None:
        raise ValidationError("reasoning_effort", "is not supported by this server on /v1/completions "
                                                  "(a chat template's input: /v1/chat/completions takes it)")
    _check_best_of(body)
    req = OpenAIRequest("completion", _model(body, served_model), _generate_base(body), stream=_stream(body))
    _stream_options(body, req)
    gen = req.generate
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        gen.text = prompt
        if echo:
            req.echo_texts = [prompt] if isinstance(prompt, str) else prompt
    elif isinstance(prompt, list) and prompt:
        gen.input_ids = prompt
        if echo:
            req.echo_ids = prompt if all(isinstance(t, list) for t in prompt) else [prompt]
    else:
        raise ValidationError("prompt", "must be a string, a list of strings, token ids or lists of token ids")
    gen.sampling_params = _sampling(body, req, default_max_tokens=16)
    if body.get("require_reasoning") is not None:
        gen.require_reasoning = body["require_reasoning"]
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= 20:
            raise ValidationError("logprobs", f"must be an integer in [0, 20], got {logprobs!r}")
        req.logprobs = True
        gen.return_logprob, gen.top_logprobs_num, gen.return_text_in_logprobs = True, logprobs, True
    if echo and req.logprobs:  # OpenAI's echo + logprobs: the prompt's tokens are scored too
        req.echo_logprobs = True
        gen.logprob_start_len = 0
    return req


def _check_best_of(body: dict) -> None:
    """OpenAI's best_of samples best_of candidates and answers with the n most likely. This server
    does not pick among candidates, so only a best_of that picks nothing (equal to n) passes;
    SGLang accepts any best_of and ignores it, answering with n unranked choices."""
    best_of, n = body.get("best_of"), body.get("n")
    n = 1 if n is None else n
    if best_of is None or not is_int(n):  # a bad n is named by its own check
        return
    if not is_int(best_of) or best_of < 1:
        raise ValidationError("best_of", f"must be a positive integer, got {best_of!r}")
    if best_of != n:
        raise ValidationError("best_of", f"is {best_of} with n = {n}: choosing the n best of best_of candidates is "
                                         "not supported by this server (give best_of equal to n, or leave it out)")


def decode_echo(req: OpenAIRequest, tokenizer: Any) -> None:
    """Give each echoed token-id prompt its text: without special tokens, as SGLang's; with them
    when the prompt's logprobs come too, whose tokens must join into the echoed text. Call it
    once the ids passed validation."""
    if req.echo_ids:
        req.echo_texts = [tokenizer.decode(ids, skip_special_tokens=not req.logprobs) for ids in req.echo_ids]


def chat_request(body: Any, served_model: str, render: Callable[[list, dict], str],
                 reasoning_parser: str | None = None, sampling_defaults: dict[str, Any] | None = None,
                 content_format: str = "string", tool_call_parser: str | None = None,
                 template_defaults: dict[str, Any] | None = None) -> OpenAIRequest:
    """`sampling_defaults`: the model's recommended sampling, for the fields the request leaves out.
    `content_format`: the chat template's (`tokenizer.template_content_format`). `tool_call_parser`:
    the server's (--tool-call-parser). `template_defaults`: --default-chat-template-kwargs, under
    the request's own chat_template_kwargs."""
    _check_object(body)
    tools = tool_request(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValidationError("messages", "must be a non-empty list of message objects")
    messages = [_flat_message(i, m, content_format) for i, m in enumerate(messages)]
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise ValidationError("chat_template_kwargs", f"must be an object, got {kwargs!r}")
    kwargs = {**(template_defaults or {}), **kwargs}
    for key in _RENDER_ARGS.intersection(kwargs):  # apply_chat_template would fail on a second value
        raise ValidationError(f"chat_template_kwargs.{key}", "is set by the server (continue a final assistant "
                              "message with the request's continue_final_message)")
    kwargs = _with_effort(body.get("reasoning_effort"), kwargs)
    if tools is not None:
        if "tools" in kwargs:  # apply_chat_template would take two
            raise ValidationError("chat_template_kwargs.tools", "cannot be combined with tools; give them as tools")
        kwargs = {**kwargs, "tools": tools.template_tools()}
    req = OpenAIRequest("chat", _model(body, served_model), _generate_base(body), stream=_stream(body),
                        add_special_tokens=False, tools=tools)
    _stream_options(body, req)
    separate = body.get("separate_reasoning")
    if separate is not None and not isinstance(separate, bool):
        raise ValidationError("separate_reasoning", f"must be a boolean, got {separate!r}")
    parser = ReasoningParser.for_request(reasoning_parser, kwargs) if reasoning_parser else None
    if separate is not False:  # SGLang's default: separate when a parser is set
        req.reasoning = parser
    if body.get("input_ids") is not None:  # SGLang's extension: the prompt's ids, no template
        req.generate.input_ids = body["input_ids"]
    else:
        req.generate.text = _render(messages, kwargs, render, _flag(body, "continue_final_message"))
    req.generate.sampling_params = {**(sampling_defaults or {}), **_sampling(body, req, default_max_tokens=None)}
    if tools is not None:
        tool_sampling(tools, tool_call_parser, req)
    _require_reasoning(body, req.generate, parser)
    if _flag(body, "logprobs"):
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20:
            raise ValidationError("top_logprobs", f"must be an integer in [0, 20], got {top!r}")
        req.logprobs = True
        req.generate.return_logprob, req.generate.top_logprobs_num, req.generate.return_text_in_logprobs = True, top, True
    elif body.get("top_logprobs") is not None:
        raise ValidationError("top_logprobs", "needs logprobs: true")
    return req


def _with_effort(effort: Any, kwargs: dict) -> dict:
    """As SGLang: the effort, a tier or SGLang's fine-grained number, goes to the chat template (one
    that ignores it renders alike), and "none" switches thinking off unless chat_template_kwargs
    says otherwise."""
    if effort is None:
        return kwargs
    fine_grained = isinstance(effort, (int, float)) and not isinstance(effort, bool) and 0 <= effort <= 0.99
    if not fine_grained and effort not in _EFFORTS:
        msg = f"must be one of {', '.join(_EFFORTS)} or a number in [0, 0.99] (SGLang's), got {effort!r}"
        raise ValidationError("reasoning_effort", msg)
    off = {"thinking": False, "enable_thinking": False} if effort == "none" else {}
    return {"reasoning_effort": effort, **off, **kwargs}


def _render(messages: list[dict], kwargs: dict, render: Callable[[list, dict], str], continue_final: bool) -> str:
    """The prompt text, with SGLang's handling of a final assistant message: with
    `continue_final_message` the answer continues it (its text follows the generation prompt);
    otherwise it is rendered as a user message, so the prompt always ends on the user's side. A
    list of parts (a template that loops over them) stays as it is, as SGLang's."""
    prefix = ""
    if messages[-1]["role"] == "assistant" and isinstance(messages[-1]["content"], str):
        if continue_final:
            prefix, messages = messages[-1]["content"], messages[:-1]
        else:
            messages = [*messages[:-1], {**messages[-1], "role": "user"}]
    try:
        return render(messages, kwargs) + prefix
    except Exception as exc:  # a template error is the request's fault (a role it does not accept, ...)
        raise ValidationError("messages", f"cannot be rendered by the chat template: {exc}") from None


def _flat_message(i: int, message: dict, content_format: str = "string") -> dict:
    """Roles lowercased, as SGLang's protocol does; a null content is empty (an assistant turn that
    only called tools); text content parts joined by spaces for a template that takes a string, as
    SGLang does, and kept as the list for one that loops over them (but a tool result's, as SGLang's
    normalize_tool_content)."""
    role = message.get("role")
    if not isinstance(role, str) or role.lower() not in _ROLES:
        raise ValidationError(f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
    message = {**message, "role": role.lower()}
    if message.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(i, message["tool_calls"])
    content = message.get("content")
    if content is None:
        if message["role"] == "user":  # the others may go without (an assistant's tool calls), as SGLang's
            raise ValidationError(f"messages[{i}].content", "is required for a user message")
        return {**message, "content": ""}
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValidationError(f"messages[{i}].content", "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else None
            raise ValidationError(f"{where}.type", f"only text parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValidationError(f"{where}.text", "must be a string")
        texts.append(part["text"])
    if content_format == "openai" and message["role"] != "tool":
        return message
    return {**message, "content": " ".join(texts)}


def _tool_calls(i: int, calls: Any) -> list:
    """An earlier turn's tool calls, their `function.arguments` parsed from the JSON string OpenAI
    clients send into an object, as SGLang hands them to the template: templates write them with
    `| tojson`, which would quote the string a second time."""
    if not isinstance(calls, list):
        raise ValidationError(f"messages[{i}].tool_calls", "must be a list of tool calls")
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValidationError(f"messages[{i}].tool_calls[{j}].function", "is required: an object")
        args = function.get("arguments")
        if isinstance(args, str):
            args = _arguments_object(f"messages[{i}].tool_calls[{j}].function.arguments", args)
            call = {**call, "function": {**function, "arguments": args}}
        parsed.append(call)
    return parsed


def _arguments_object(where: str, arguments: str) -> dict:
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        raise ValidationError(where, f"must be valid JSON, got {arguments[:50]!r}") from None
    if not isinstance(value, dict):
        raise ValidationError(where, f"must be a JSON object, got {arguments[:50]!r}")
    return value


def _require_reasoning(body: dict, gen: GenerateRequest, parser: ReasoningParser | None) -> None:
    """Chat on a reasoning server reasons first unless the client says otherwise or the template
    switched thinking off (SGLang's _get_reasoning_from_request): a constrained answer's grammar
    holds after `</think>`, and the tokens through it count as usage.reasoning_tokens."""
    if body.get("require_reasoning") is not None:
        gen.require_reasoning = body["require_reasoning"]
    elif parser is not None:
        gen.require_reasoning = parser.starts_inside


def _check_object(body: Any) -> None:
    if not isinstance(body, dict):
        raise ValidationError("body", "must be a JSON object")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, [], {}, False, ""):  # what clients send for "not used" passes
            raise ValidationError(name, "is not supported by this server")


def _check_tools(body: dict) -> None:
    """Completions call no tools (chat does): a request that could call one is a 400. What asks
    for no call passes, as SGLang ignores it: tools with `tool_choice: "none"`, `tool_choice` "none"
    or "auto" without tools, `parallel_tool_calls` (a flag about calls that cannot happen)."""
    choice, tools = body.get("tool_choice"), body.get("tools")
    if tools not in (None, []) and choice != "none":
        raise ValidationError("tools", "is not supported on /v1/completions (/v1/chat/completions takes them; "
                                       "tool_choice \"none\" ignores them)")
    if choice not in (None, "none", "auto"):
        raise ValidationError("tool_choice", "is not supported by this server")
    if not isinstance(body.get("parallel_tool_calls", False), bool):
        raise ValidationError("parallel_tool_calls", "must be a boolean")


def _model(body: dict, served_model: str) -> str:
    """The model the answer names. SGLang reads "base:adapter" as a LoRA adapter to serve with; with
    no LoRA here, such a name is refused rather than answered by the base model."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValidationError("model", "must be a string")
    if model and ":" in model and model != served_model:
        adapter = model.split(":", 1)[1]
        raise ValidationError("model", f"names the LoRA adapter {adapter!r}; this server serves no LoRA adapters")
    return model or served_model


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ValidationError(name, f"must be a boolean, got {v!r}")
    return bool(v)


def _stream(body: dict) -> bool:
    return _flag(body, "stream")


def _generate_base(body: dict) -> GenerateRequest:
    """A streamed answer streams from the scheduler too (else it arrives as one final delta)."""
    gen = GenerateRequest(stream=True if _stream(body) else None)
    for name in _NATIVE_TOP:
        if body.get(name) is not None:
            setattr(gen, name, body[name])
    return gen


def _stream_options(body: dict, req: OpenAIRequest) -> None:
    opts = body.get("stream_options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise ValidationError("stream_options", "must be an object")
    req.include_usage = _flag(opts, "include_usage")
    req.continuous_usage = _flag(opts, "continuous_usage_stats")  # on its own, as SGLang's


def _sampling(body: dict, req: OpenAIRequest, default_max_tokens: int | None) -> dict[str, Any]:
    sp: dict[str, Any] = {}
    for name, native in _SAMPLING.items():
        if body.get(name) is not None:
            sp[native or name] = body[name]
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins when both are given
        if body.get(name) is not None:
            value = body[name]
            if type(value) is int and value <= 0:  # OpenAI and SGLang's protocol refuse it; native 0 stays valid
                raise ValidationError(name, f"must be positive, got {value}")
            sp["max_new_tokens"], req.renames["max_new_tokens"] = value, name
            break
    else:  # chat: None, as many as fit (SGLang's chat sends null); completions: OpenAI's 16
        sp["max_new_tokens"] = default_max_tokens
    # vLLM's name for keeping a matched stop string (SGLang's protocol drops the field unread)
    if _flag(body, "include_stop_str_in_output") and "no_stop_trim" not in sp:
        sp["no_stop_trim"], req.renames["no_stop_trim"] = True, "include_stop_str_in_output"
    if body.get("response_format") is not None and (constraint := response_format_constraint(body["response_format"])):
        kind, sp[kind] = constraint
        req.renames[kind] = "response_format"
    apply_vllm_fields(body, sp, req.renames)
    return sp

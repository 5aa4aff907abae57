"""OpenAIRequest: an OpenAI request as the typed GenerateRequest it asks for, and what shaping its answer needs."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tandem.runtime.frontend.generate_request import GenerateRequest
from tandem.runtime.reasoning import ReasoningParser
from tandem.runtime.tools.parser import ToolFormat
from tandem.runtime.tools.request import ToolRequest
from tandem.runtime.value_checks import ValidationError

_NATIVE_TO_OPENAI = {"min_new_tokens": "min_tokens", "sampling_seed": "seed"}
_SAMPLING_FIELD = re.compile(r"sampling_params(?:\[\d+\])?\.(\w+)(.*)")
_PROMPT_FIELD = re.compile(r"(?:text|input_ids)(.*)")


@dataclass
class OpenAIRequest:
    """A request: what it asks the tokenizer manager for, and what shaping the answer needs."""

    kind: str  # "completion" | "chat" | "response" (/v1/responses: a chat request answered in its shape)
    model: str
    generate: GenerateRequest
    # native sampling field -> the name this client sent it under, where that differs per request
    renames: dict[str, str] = field(default_factory=lambda: {"max_new_tokens": "max_tokens"})
    logprobs: bool = False
    echo_texts: list[str] = field(default_factory=list)  # completions with echo: each prompt's text
    # echoed token-id prompts: decoded into echo_texts (`decode_echo`) only once the server has
    # checked the ids, since the tokenizer fails on ids that are not token ids
    echo_ids: list[list[int]] = field(default_factory=list)
    echo_logprobs: bool = False  # echo with logprobs: the legacy logprobs start at the prompt
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    stream: bool = False
    reasoning: ReasoningParser | None = None  # chat: split reasoning_content off the answer
    add_special_tokens: bool = True  # a text prompt's BOS; a chat template writes its own
    echoed: dict[str, Any] = field(default_factory=dict)  # /v1/responses: the request fields its answer repeats
    tools: ToolRequest | None = None  # chat: the tools a call may name
    tool_format: ToolFormat | None = None  # chat: the format the answer's calls are parsed in (None: not parsed)

    @property
    def native(self) -> dict[str, Any]:
        """The request as the /generate body that asks for the same (the fields it sets)."""
        return self.generate.fields()

    @property
    def sampling(self) -> dict[str, Any]:
        """The request's sampling params (native names), shared by its prompts."""
        return self.generate.sampling_params

    def rename(self, exc: ValidationError) -> ValidationError:
        """A native field name in a validation error -> the OpenAI one the client sent."""
        name = exc.field
        if m := _SAMPLING_FIELD.match(name):  # sampling_params[.i].<native>[rest]
            native, rest = m.groups()
            name = (self.renames.get(native) or _NATIVE_TO_OPENAI.get(native, native)) + rest
        elif m := _PROMPT_FIELD.match(name):  # chat: the rendered messages, or the client's input_ids
            if self.kind == "completion":
                name = "prompt" + m.group(1)
            elif self.generate.text is not None:
                name = "messages" if self.kind == "chat" else "input"
        elif name == "rid" and self.kind == "response":
            name = "request_id"
        elif name.startswith("top_logprobs_num"):
            name = "top_logprobs" if self.kind == "chat" else "logprobs"
        # a message that compares with another field names it as this client knows it too
        # ("regex cannot be combined with json_schema" when the schema came as response_format)
        message = exc.message
        for native, sent in self.renames.items():
            message = re.sub(rf"\b{native}\b", sent, message)
        return ValidationError(name, message)

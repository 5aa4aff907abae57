"""Reasoning parsers: split a chat answer into `reasoning_content` and `content` at the think tags.

`deepseek-r1`: the chat template opens `<think>` itself, so the answer starts inside the
reasoning: everything before `</think>` is reasoning (all of it while `</think>` has not come).
`qwen3`: the same while thinking is on (`chat_template_kwargs.enable_thinking` anything but
false, as Qwen3's template reads it), whether the model writes `<think>` or the template opened
it; with thinking off, reasoning only when the answer opens with `<think>`.

Streaming (`ReasoningStream`) reads each step's new text once, holding back only what `split`
holds back (opening whitespace and a partial `<think>`, trailing whitespace and a partial
`</think>`), so what was sent as reasoning is never taken back and the deltas of every step are
the ones the whole-text split of the answer so far would give. With SGLang's `stream_reasoning: false`
the reasoning is held back whole and sent as one delta: in the step whose text closes it
(`</think>`), or the finishing one when it never closes, but not when the request was aborted
(SGLang flushes its held reasoning only at a finish that is not an abort).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tandem.runtime.text_stream import partial_tag_len
from tandem.runtime.value_checks import ValidationError, check_fields

THINK_START, THINK_END = "<think>", "</think>"
PARSERS = ("deepseek-r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the answer is reasoning until `</think>`, with or without `<think>`
    stream_reasoning: bool = True  # False: a stream sends the reasoning in one piece once it is whole

    @classmethod
    def for_request(cls, name: str, template_kwargs: dict) -> "ReasoningParser":
        return cls(name, name == "deepseek-r1" or template_kwargs.get("enable_thinking") is not False)

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """(reasoning, content). Not final: a tail that may still grow into a tag is left out."""
        body = text.lstrip()
        if body.startswith(THINK_START):
            body = body[len(THINK_START):]
        elif not final and THINK_START.startswith(body):  # "<thi" may become "<think>"
            return "", ""
        elif not self.starts_inside:
            return "", text
        body = body.lstrip()
        end = body.find(THINK_END)
        if end >= 0:
            return body[:end].rstrip(), body[end + len(THINK_END):].lstrip()
        if not final:  # whitespace may turn out to precede the end tag: hold it back too
            body = body[:len(body) - partial_tag_len(body, (THINK_END,))].rstrip()
        return body, ""


def with_stream_reasoning(parser: ReasoningParser | None, body: dict) -> ReasoningParser | None:
    """The chat request's `stream_reasoning` (SGLang's ChatCompletionRequest field, default true) on
    its parser; checked whether or not the server has a parser, as SGLang's schema checks it."""
    value: Any = body.get("stream_reasoning")
    if value is not None and not isinstance(value, bool):
        raise ValidationError("stream_reasoning", f"must be a boolean, got {value!r}")
    return parser if parser is None or value is None else replace(parser, stream_reasoning=value)


_OPEN, _THINK, _AFTER, _CONTENT = range(4)  # ReasoningStream's phases


class ReasoningStream:
    """Deltas of reasoning and content from the deltas of one answer, O(new text) per step.

    Phases: OPEN (only whitespace and a prefix of `<think>` so far: undecided), THINK (inside the
    reasoning), AFTER (past `</think>`: content, its leading whitespace dropped) and CONTENT (no
    reasoning at all). `pending` holds what is read but not yet sent: in OPEN the text so far, in
    THINK the unsent tail of the reasoning (trailing whitespace and a partial `</think>`), which
    is all a `</think>` that ends in later text can start in. Invariant: the deltas of each step
    are those `split` of the answer so far would give over the previous step's (held back whole,
    with `stream_reasoning` off, until it closes or the answer finishes unaborted)."""

    __slots__ = ("parser", "phase", "pending", "lead", "held")

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.phase = _OPEN
        self.pending = ""
        self.lead = True  # THINK / AFTER: still dropping the part's leading whitespace
        self.held: list[str] = []  # stream_reasoning off: reasoning read but not sent yet

    def feed(self, delta: str, final: bool, aborted: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for the step that adds `delta`. `final`: the answer
        finished with this step; `aborted`: and it was an abort."""
        reasoning, content = self._step(delta, final)
        if self.parser.stream_reasoning:
            return reasoning, content
        if reasoning:
            self.held.append(reasoning)
        if not (self.phase == _AFTER or (final and not aborted)):  # AFTER: `</think>` was read
            return "", content
        reasoning, self.held = "".join(self.held), []
        return reasoning, content

    def _step(self, delta: str, final: bool) -> tuple[str, str]:
        if self.phase == _CONTENT:
            return "", delta
        if self.phase == _AFTER:
            return "", self._content(delta)
        if self.phase == _THINK:
            return self._think(delta, final)
        self.pending += delta
        body = self.pending.lstrip()
        if body.startswith(THINK_START):
            body = body[len(THINK_START):]
        elif not final and THINK_START.startswith(body):  # "<thi" may become "<think>"
            return "", ""
        elif not self.parser.starts_inside:
            text, self.pending, self.phase = self.pending, "", _CONTENT
            return "", text
        self.pending, self.phase = "", _THINK
        return self._think(body, final)

    def _think(self, delta: str, final: bool) -> tuple[str, str]:
        if self.lead:
            delta = delta.lstrip()
            if not delta:
                return "", ""
            self.lead = False
        text = self.pending + delta
        end = text.find(THINK_END)
        if end >= 0:
            self.pending, self.phase, self.lead = "", _AFTER, True
            return text[:end].rstrip(), self._content(text[end + len(THINK_END):])
        if final:
            self.pending = ""
            return text, ""
        sent = text[:len(text) - partial_tag_len(text, (THINK_END,))].rstrip()
        self.pending = text[len(sent):]
        return sent, ""

    def _content(self, delta: str) -> str:
        if self.lead:
            delta = delta.lstrip()
            self.lead = not delta
        return delta


class StreamSplitter:
    """Deltas of reasoning and content from cumulative answers (a ReasoningStream over what each grew by)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.stream = ReasoningStream(parser)
        self.read = 0

    def feed(self, text: str, final: bool, aborted: bool = False) -> tuple[str, str]:
        """`final`: the request finished with this text; `aborted`: and it was an abort."""
        delta, self.read = text[self.read:], max(self.read, len(text))
        return self.stream.feed(delta, final, aborted)


def separate_reasoning(body: Any) -> dict[str, str]:
    """SGLang's /separate_reasoning: {"text", "reasoning_parser"} -> {"text": the answer,
    "reasoning_text": the reasoning}, split as a whole answer with thinking on."""
    check_fields(body, ("text", "reasoning_parser"), "/separate_reasoning")
    if not isinstance(body.get("text"), str):
        raise ValidationError("text", "is required: a string")
    name = body.get("reasoning_parser")
    if name not in PARSERS:
        raise ValidationError("reasoning_parser", f"must be one of {', '.join(PARSERS)}, got {name!r}")
    reasoning, content = ReasoningParser(name, starts_inside=True).split(body["text"])
    return {"text": content, "reasoning_text": reasoning}

"""The tokenizer manager's choices -> the OpenAI API's response, stream chunk and error shapes
(the requests: openai; /v1/responses: responses_api).

Rendered from each ChoiceState's fields (text, finish_reason, counters, prompt_tokens, its
logprob rows), never from a /generate result dict. A stream keeps a cursor per choice and reads
only what each step added: O(new text) per chunk, the reasoning split included.
"""
from __future__ import annotations

import secrets
import time
from typing import Any, AsyncIterator

from tandem.runtime.frontend.request_groups import CallStream, ChoiceState, RequestError
from tandem.runtime.server.openai_request import OpenAIRequest
from tandem.runtime.server.openai_tools import ChoiceCalls, delta_calls, finish_reason, message_calls, parser_for
from tandem.runtime.reasoning import ReasoningStream
from tandem.runtime.tools.parser import ToolStream
from tandem.runtime.value_checks import ValidationError

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _id(req: OpenAIRequest) -> str:
    """The client's rid (a batch's first), as SGLang's answer carries its request's id; else a fresh one."""
    rid = req.generate.rid
    rid = rid[0] if isinstance(rid, list) and rid else rid
    return rid if isinstance(rid, str) else ("chatcmpl-" if req.kind == "chat" else "cmpl-") + secrets.token_hex(12)


def _finish(c: ChoiceState) -> tuple[str | None, Any]:
    fr = c.finish_reason
    if fr is None:
        return None, None
    return _FINISH.get(fr.type, fr.type), fr.matched if fr.type == "stop" else None


def usage(choices: list[ChoiceState], n: int) -> dict[str, Any]:
    """Prompt tokens once per prompt (not per choice), as OpenAI counts them; SGLang's
    `reasoning_tokens` (its UsageInfo field) sums every choice's."""
    firsts = choices[::max(n, 1)]
    prompt = sum(c.prompt_tokens for c in firsts)
    return {**_counts(prompt, choices),
            "prompt_tokens_details": {"cached_tokens": sum(c.counters.cached_tokens for c in firsts)}}


def _counts(prompt: int, choices: list[ChoiceState]) -> dict[str, Any]:
    """SGLang's top-level reasoning_tokens, and OpenAI's completion_tokens_details beside it."""
    completion = sum(c.counters.completion_tokens for c in choices)
    reasoning = sum(c.counters.reasoning_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "reasoning_tokens": reasoning, "completion_tokens_details": {"reasoning_tokens": reasoning}}


def _chat_logprobs(meta: dict, start: int = 0) -> dict[str, Any]:
    tops = meta.get("output_top_logprobs") or []
    content = []
    for i, (lp, _tid, text) in enumerate(meta["output_token_logprobs"][start:], start):
        top = [{"token": t, "logprob": v, "bytes": list(t.encode())} for v, _, t in (tops[i] if i < len(tops) else [])]
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content}


def _completion_logprobs(meta: dict, offset: int, start: int = 0, prompt: bool = False) -> dict[str, Any]:
    """The legacy shape: parallel lists, top_logprobs as {token: logprob} per position. With
    `prompt` (echo), the prompt's tokens come first; the first has no logprob (null), as OpenAI's."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    sides = [("input", 0)] if prompt else []
    for side, first in [*sides, ("output", start)]:
        top_rows = meta.get(f"{side}_top_logprobs") or []
        for i, (lp, _tid, text) in enumerate(meta[f"{side}_token_logprobs"][first:], first):
            text = text or ""
            top = top_rows[i] if i < len(top_rows) else []
            out["text_offset"].append(offset)
            offset += len(text)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if lp is None else _top_by_text(top or []))
    return out


def _top_by_text(top: list) -> dict[str, float]:
    """The legacy top_logprobs dict: tokens that decode alike (byte-fallback pieces all read as
    U+FFFD) keep the most likely one's logprob (SGLang's dict keeps the last, least likely one's,
    beside a key that ranks first: a value no top-k holds there)."""
    out: dict[str, float] = {}
    for lp, _tid, text in top:
        out.setdefault(text, lp)
    return out


def response(req: OpenAIRequest, finished: list[ChoiceState], n: int) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(finished):
        reason, matched = _finish(c)
        meta = c.logprob_meta() if req.logprobs else {}
        if req.kind == "chat":
            # SGLang's message always carries these keys (null here): clients read them unguarded;
            # `reasoning` is vLLM's name for reasoning_content (its clients read that one)
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "reasoning_content": None,
                                       "reasoning": None, "tool_calls": None}
            if req.reasoning is not None:
                reasoning, content = req.reasoning.split(c.text)
                message.update(content=content, reasoning_content=reasoning or None, reasoning=reasoning or None)
            if req.tools is not None:
                message["content"], message["tool_calls"] = message_calls(req, message["content"])
                if message["tool_calls"]:
                    reason, matched = finish_reason(reason, True), (None if reason == "stop" else matched)
            choice = {"index": i, "message": message, "logprobs": _chat_logprobs(meta) if req.logprobs else None}
        else:
            echo = req.echo_texts[i // max(n, 1)] if req.echo_texts else ""
            logprobs = _completion_logprobs(meta, 0, prompt=True) if req.echo_logprobs else (
                _completion_logprobs(meta, len(echo)) if req.logprobs else None)
            choice = {"index": i, "text": echo + c.text, "logprobs": logprobs}
        choices.append({**choice, "finish_reason": reason, "matched_stop": matched})
    return {"id": _id(req), "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": choices, "usage": usage(finished, n)}


async def stream_chunks(req: OpenAIRequest, updates: CallStream, n: int) -> AsyncIterator[dict]:
    """Choice updates -> OpenAI delta chunks (then a usage chunk when asked). A chat stream is
    SGLang's (and OpenAI's) shape: per choice the role's chunk first (empty content), then text
    deltas, and once every choice's text is out one finish chunk per choice (empty delta), in the
    order they finished. A completion's last delta carries its finish reason. Each update is read
    at once, before the first of its chunks goes out (the choice may grow while one is sent)."""
    rid, created = _id(req), int(time.time())
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    sent_text: dict[int, int] = {}
    sent_lp: dict[int, int] = {}
    last: dict[int, ChoiceState] = {}
    chat = _ChatStream(req)

    def chunk(choice: dict, c: ChoiceState | None = None) -> dict:
        out = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
        if c is not None and req.continuous_usage:  # this choice's counts so far, as SGLang's
            out["usage"] = _counts(c.prompt_tokens, [c])
        return out

    async for c in updates:
        if updates.error is not None:
            yield error_event(req, updates.error)
            return
        i = c.index
        last[i] = c
        first = i not in sent_text
        text_start = sent_text.get(i, 0)
        delta_text = c.text_from(text_start)
        sent_text[i] = text_start + len(delta_text)
        if req.kind == "chat":
            chunks = [chunk(choice, c if counted else None) for choice, counted in chat.step(i, c, first, delta_text)]
            for out in chunks:
                yield out
            continue
        reason, matched = _finish(c)
        meta = c.logprob_meta() if req.logprobs else {}
        lp_start = sent_lp.get(i, 0)
        sent_lp[i] = len(meta.get("output_token_logprobs") or [])
        echo = req.echo_texts[i // max(n, 1)] if req.echo_texts else ""
        with_prompt = first and req.echo_logprobs
        offset = 0 if with_prompt else len(echo) + text_start
        yield chunk({"index": i, "text": (echo if first else "") + delta_text,
                     "logprobs": _completion_logprobs(meta, offset, lp_start, with_prompt) if req.logprobs else None,
                     "finish_reason": reason, "matched_stop": matched}, c)
    for choice in chat.finished.values():
        yield chunk(choice)
    if req.include_usage and last:
        yield {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
               "usage": usage([last[i] for i in sorted(last)], n)}


class _ChatStream:
    """A chat stream's per-choice state: its reasoning splitter, its tool-call split (over the
    content the reasoning split leaves), the logprobs sent (they ride with the chunks that show
    their text, so a held-back token's wait, and none is sent twice), and its finish chunk, held
    until every choice's text is out."""

    def __init__(self, req: OpenAIRequest) -> None:
        self.req = req
        self.splitters: dict[int, ReasoningStream] = {}
        self.calls: dict[int, ChoiceCalls] = {}
        self.sent_lp: dict[int, int] = {}
        self.finished: dict[int, dict] = {}

    def step(self, i: int, c: ChoiceState, first: bool, delta_text: str) -> list[tuple[dict, bool]]:
        """This step's chunks for choice `i` (`delta_text`: what its text grew by), each with whether
        it carries continuous usage (SGLang's text chunks do; the role's and the finish chunks do not)."""
        reason, matched = _finish(c)
        meta = c.logprob_meta() if self.req.logprobs else {}
        out = [(self._choice(i, {"role": "assistant", "content": ""}), False)] if first else []
        deltas = []
        if self.req.reasoning is not None:
            splitter = self.splitters.setdefault(i, ReasoningStream(self.req.reasoning))
            reasoning, delta_text = splitter.feed(delta_text, reason is not None, aborted=reason == "abort")
            if reasoning:  # the think end inside this step's text: one delta each, as SGLang's
                deltas.append({"reasoning_content": reasoning, "reasoning": reasoning})  # SGLang's and vLLM's names
        called = False
        calls = self.calls.get(i)
        if calls is None and (parser := parser_for(self.req)) is not None:  # a parser per choice, not per step
            calls = self.calls[i] = ChoiceCalls(ToolStream(parser))
        if calls is not None:
            delta_text, call_deltas = calls.feed(delta_text, reason is not None)
            called = calls.called
        else:
            call_deltas = []
        if delta_text:
            deltas.append({"content": delta_text})
        if call_deltas:
            deltas.append({"tool_calls": delta_calls(call_deltas)})
        for delta in deltas:  # the step's logprobs go with its first delta, as SGLang's
            out.append((self._choice(i, delta, self._logprobs(i, meta)), True))
        if reason is not None:  # what no delta showed (a trimmed stop string's) ends with the finish
            self.finished[i] = {**self._choice(i, {}, self._logprobs(i, meta)),
                                "finish_reason": finish_reason(reason, called),
                                "matched_stop": None if called and reason == "stop" else matched}
        return out

    def _choice(self, i: int, delta: dict, logprobs: dict | None = None) -> dict:
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None, "matched_stop": None}

    def _logprobs(self, i: int, meta: dict) -> dict | None:
        start, end = self.sent_lp.get(i, 0), len(meta.get("output_token_logprobs") or [])
        if not self.req.logprobs or start == end:
            return None
        self.sent_lp[i] = end
        return _chat_logprobs(meta, start)


def error_event(req: OpenAIRequest, err: RequestError | ValidationError) -> dict[str, Any]:
    """The SSE event a stream that failed after its start ends with, as SGLang sends it."""
    if isinstance(err, ValidationError):
        err = req.rename(err)
        return error_body(400, str(err), err.field)
    return error_body(err.status_code, err.message)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
            408: "RequestTimeoutError", 413: "BadRequestError", 415: "BadRequestError", 429: "RateLimitError",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    # OpenAI's nested shape, and SGLang's top-level fields beside it for clients written for SGLang
    fields = {"message": message, "type": kind, "param": param, "code": status}
    return {"object": "error", **fields, "error": fields}

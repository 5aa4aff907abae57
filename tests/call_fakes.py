"""Fake choices and CallStreams for the answer-shape tests (OpenAI and /v1/responses): what the
tokenizer manager hands the HTTP layer, without a server. A fake choice is its native result
dict (tests edit it as one) read through ChoiceState's fields, so each step of a fake stream is a
snapshot of the choice with its cumulative text."""
from __future__ import annotations

from typing import Any

from tandem.ipc.messages import FinishReason, ReqCounters
from tandem.runtime.frontend.request_groups import CallStream, RequestError
from tandem.runtime.value_checks import ValidationError


class _Choice:
    """What a CallStream asks of the choice a chunk is of."""

    def __init__(self, err: RequestError | ValidationError | None = None) -> None:
        self.err = err

    def error(self) -> RequestError | ValidationError | None:
        return self.err


class FakeChoice(dict):
    """A native result dict that reads as a ChoiceState (text, text_from, index, prompt_tokens,
    counters, finish_reason, logprob_meta), each field read from the dict when asked."""

    @property
    def text(self) -> str:
        return self["text"]

    @property
    def index(self) -> int:
        return self.get("index", 0)

    @property
    def prompt_tokens(self) -> int:
        return self["meta_info"]["prompt_tokens"]

    @property
    def counters(self) -> ReqCounters:
        meta = self["meta_info"]
        return ReqCounters(completion_tokens=meta["completion_tokens"], cached_tokens=meta.get("cached_tokens", 0),
                           reasoning_tokens=meta.get("reasoning_tokens", 0))

    @property
    def finish_reason(self) -> FinishReason | None:
        fr = self["meta_info"]["finish_reason"]
        return None if fr is None else FinishReason(**fr)

    def text_from(self, start: int) -> str:
        return self["text"][start:]

    def logprob_meta(self) -> dict[str, Any]:
        return self["meta_info"]


def stream_of(*items: dict, error: RequestError | ValidationError | None = None) -> CallStream:
    """A CallStream of `items`, the last one failing with `error`."""
    async def pairs():
        for i, item in enumerate(items):
            yield _Choice(error if i == len(items) - 1 else None), item

    return CallStream(pairs(), lambda: None)


def result(text: str, index: int, prompt: int = 5, completion: int = 2, cached: int = 1,
           finish: dict | None = None) -> FakeChoice:
    return FakeChoice({"text": text, "index": index, "meta_info": {
        "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
        "finish_reason": finish, "input_token_logprobs": [[None, 1, "p"], [-3.0, 2, "q"]],
        "input_top_logprobs": [None, [[-0.1, 4, "r"]]], "output_token_logprobs": [[-0.5, 7, text[:1]], [-1.0, 8, text[1:]]][:completion],
        "output_top_logprobs": [[[-0.5, 7, text[:1]], [-2.0, 9, "z"]], [[-1.0, 8, text[1:]]]][:completion]}})

"""The OpenAI and Responses streams read each step's new text once: a long answer streamed a token
at a time costs O(its length), counted on the characters read from the choice's text (a stream
that re-read or re-split the cumulative text would read O(n²) of them, or fail on the counting text)."""
from __future__ import annotations

import asyncio

import pytest

from tandem.ipc.messages import FinishReason, ReqCounters
from tandem.runtime.frontend.request_groups import CallStream
from tandem.runtime.server import openai as oa
from tandem.runtime.server import openai_format as oar
from tandem.runtime.server import responses_api as ra

STEPS = 3000


class CountingText:
    """A growing answer that counts the characters read from it; only slices and len() work."""

    def __init__(self) -> None:
        self.text, self.read = "", 0

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, key: slice) -> str:
        out = self.text[key]
        self.read += len(out)
        return out


class LiveChoice:
    """One choice that grows in place between updates, as the tokenizer manager's ChoiceState does."""

    def __init__(self) -> None:
        self.text, self.index, self.prompt_tokens = CountingText(), 0, 3
        self.counters = ReqCounters(completion_tokens=0, cached_tokens=0)
        self.finish_reason: FinishReason | None = None

    def text_from(self, start: int) -> str:
        return self.text[start:]

    def logprob_meta(self) -> dict:
        return {}

    def error(self) -> None:
        return None


def _answer() -> list[str]:
    return ["<think>"] + ["plan "] * (STEPS // 2) + ["</think>"] + ["word "] * (STEPS // 2)


def _updates(choice: LiveChoice, tokens: list[str]) -> CallStream:
    async def pairs():
        for i, token in enumerate(tokens):
            choice.text.text += token
            choice.counters = ReqCounters(completion_tokens=i + 1, cached_tokens=0)
            if i == len(tokens) - 1:
                choice.finish_reason = FinishReason(type="stop")
            yield choice, choice

    return CallStream(pairs(), lambda: None)


async def _drain(events) -> list[dict]:
    return [e async for e in events]


@pytest.mark.parametrize("kind", ["chat", "completion", "response"])
def test_a_long_stream_reads_each_character_once(kind):
    body = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "completion":
        req = oa.completion_request({**body, "prompt": "p"}, "served")
    elif kind == "chat":
        req = oa.chat_request({**body, "messages": [{"role": "user", "content": "x"}]}, "served",
                              lambda messages, kw: "<prompt>", reasoning_parser="qwen3")
    else:
        req = ra.responses_request({"input": "x", "stream": True}, "served", lambda messages, kw: "<prompt>",
                                   reasoning_parser="qwen3")
    choice, tokens = LiveChoice(), _answer()
    stream = _updates(choice, tokens)
    events = ra.responses_events(req, stream) if kind == "response" else oar.stream_chunks(req, stream, 1)
    out = asyncio.run(_drain(events))
    whole = "".join(tokens)
    assert choice.text.read == len(whole)  # every character read once, none twice
    if kind == "completion":
        assert "".join(c["choices"][0]["text"] for c in out if c["choices"]) == whole
    elif kind == "chat":
        deltas = [c["choices"][0]["delta"] for c in out if c["choices"]]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        assert (reasoning, content) == req.reasoning.split(whole)
    else:
        assert out[-1]["type"] == "response.completed"
        texts = [item["content"][0]["text"] for item in out[-1]["response"]["output"]]
        assert texts == list(req.reasoning.split(whole))

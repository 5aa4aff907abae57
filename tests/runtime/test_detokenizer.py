"""The detokenizer's message handling: the scheduler's finish reason decides what is trimmed."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tandem.ipc.messages import BatchTokenIDOutput, DetokenizeParams, FinishReason, ReqCounters
from tandem.runtime.detokenizer import Detokenizer
from tandem.runtime.tokenizer import load_tokenizer

IM_END = 2


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(None)


def step(rids: list[str], ids: list[list[int]], reasons: list[FinishReason | None],
         params: list[DetokenizeParams | None]) -> BatchTokenIDOutput:
    return BatchTokenIDOutput(rids=rids, finished_reasons=reasons,
                              new_token_ids=[np.array(x, dtype=np.int32) for x in ids],
                              counters=[ReqCounters(completion_tokens=len(x), cached_tokens=0) for x in ids],
                              detokenize_params=params)


def test_each_request_trims_what_its_own_finish_reason_matched(tok: Any) -> None:
    hello, eos_text, stop_text = tok.encode("Hello world."), tok.encode("Hi") + [IM_END], tok.encode("a b. c")
    detok = Detokenizer(tok)
    keep_specials = DetokenizeParams(skip_special_tokens=False)
    with_stop = DetokenizeParams(stop_strings=(". c",))
    first = detok.handle(step(["tok", "eos", "len", "str"], [hello[:1], eos_text[:1], eos_text[:1], stop_text[:2]],
                              [None] * 4, [DetokenizeParams(), keep_specials, keep_specials, with_stop]))
    last = detok.handle(step(["tok", "eos", "len", "str"], [hello[1:], eos_text[1:], eos_text[1:], stop_text[2:]],
                             [FinishReason(type="stop", matched=hello[-1]), FinishReason(type="stop", matched=IM_END),
                              FinishReason(type="length", length=2), FinishReason(type="stop", matched=". c")],
                             [None] * 4))
    texts = [a + b for a, b in zip(first.texts, last.texts)]
    assert texts == ["Hello world", "Hi", "Hi<|im_end|>", "a b"]
    assert detok.states == {}  # finished requests leave nothing behind

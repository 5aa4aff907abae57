"""ReasoningState, the one tracker of a request's think end: the grammar of a require_reasoning
request sees only the tokens after it, strict thinking forces it once the budget is spent, and
the counters report the tokens through it."""
from __future__ import annotations

import numpy as np

from tandem.ipc.messages import TokenizedGenerateReq
from tandem.runtime.grammar.backend import GrammarBackend
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.scheduler.batch import _forced_ids
from tandem.runtime.scheduler.request import Req
from tandem.runtime.scheduler.result_processor import FinishChecker, apply_new_tokens
from tandem.runtime.scheduler.think import ReasoningState

END = (7, 8, 9)


class Recorder:
    """An xgrammar-like matcher that accepts anything and records what it saw."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.seen.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.seen) >= 2


def _req(require_reasoning: bool, max_thinking_tokens: int | None = None) -> Req:
    sp = SamplingParams(max_new_tokens=50, max_thinking_tokens=max_thinking_tokens)
    msg = TokenizedGenerateReq(rid="r_0", input_ids=np.arange(3, dtype=np.int32), sampling_params=sp, stream=False,
                               require_reasoning=require_reasoning)
    req = Req.from_message(msg, 1, 0)
    req.think = ReasoningState(END)
    return req


def test_a_partial_think_end_does_not_end_the_reasoning() -> None:
    state = ReasoningState(END)
    for tok in (1, 7, 8, 2, 7, 8):
        state.feed(tok)
        assert not state.over
    state.feed(9)
    state.feed(4)
    assert state.over and state.tokens == 7
    assert ReasoningState(()).over  # no think end known: nothing reasons


def test_the_grammar_sees_only_the_tokens_after_the_think_end() -> None:
    checker, req = FinishChecker([99], lambda ids: ""), _req(require_reasoning=True)
    req.grammar = inner = Recorder()
    for tok in (1, 7, 8, 2, 7, 8, 9):  # one token a step, as a constrained request gets them
        assert req.in_reasoning and not apply_new_tokens(req, [tok], None, None, checker)
    assert not req.in_reasoning and inner.seen == []
    assert not apply_new_tokens(req, [4], None, None, checker)
    assert apply_new_tokens(req, [5], None, None, checker)  # the grammar terminated: the request stops
    assert inner.seen == [4, 5] and req.finished_reason.type == "stop" and req.reasoning_tokens == 7


def test_without_require_reasoning_the_grammar_holds_from_the_first_token() -> None:
    checker, req = FinishChecker([99], lambda ids: ""), _req(require_reasoning=False, max_thinking_tokens=5)
    req.grammar = inner = Recorder()
    apply_new_tokens(req, [7], None, None, checker)
    assert inner.seen == [7] and not req.in_reasoning and req.reasoning_tokens == 0


def test_strict_thinking_forces_the_think_end_once_the_budget_is_spent() -> None:
    req = _req(require_reasoning=False, max_thinking_tokens=2)
    assert [_forced_ids([req], [n]) for n in range(6)] == [None, None, [7], [8], [9], None]
    closed = _req(require_reasoning=False, max_thinking_tokens=4)
    for tok in (1, 7, 8, 9):  # the model closed its thinking itself within the budget
        closed.think.feed(tok)
    assert _forced_ids([closed], [4]) is None
    late = _req(require_reasoning=False, max_thinking_tokens=1)
    for tok in (1, 7, 8, 9):  # closed, but past the budget: the forcing already ran its course
        late.think.feed(tok)
    assert _forced_ids([late], [2]) == [8]


def test_a_reasoning_row_masks_nothing_and_the_grammar_row_is_masked(smol_tokenizer) -> None:
    backend = GrammarBackend(smol_tokenizer, 49152)
    try:
        compiled = backend.compile("regex", "[0-9]+").result(timeout=60)
        bitmask = backend.bitmask_buffer(2)
        backend.fill_bitmask([None, backend.matcher(compiled)], bitmask)  # None: the row still reasons
        allowed = lambda row: int(sum(bin(w & 0xFFFFFFFF).count("1") for w in bitmask[row].tolist()))  # noqa: E731
        assert allowed(0) == bitmask.shape[1] * 32
        assert 0 < allowed(1) < 1000  # digits only
    finally:
        backend.close()

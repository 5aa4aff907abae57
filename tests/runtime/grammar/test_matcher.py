"""RequestGrammar: the reasoner phase in front of a request's grammar. While reasoning the
grammar sees nothing and masks nothing; once the (multi-token) think-end sequence has been
written, it constrains every later token; without require_reasoning it holds from the start."""
from __future__ import annotations

from tandem.runtime.grammar.backend import GrammarBackend
from tandem.runtime.grammar.matcher import RequestGrammar


class Recorder:
    """An xgrammar-like matcher that accepts anything and records what it saw."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.seen.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.seen) >= 2


def test_grammar_sees_only_the_tokens_after_the_think_end_sequence():
    inner = Recorder()
    g = RequestGrammar(inner, think_end_ids=(7, 8, 9))
    for tok in (1, 7, 8, 2, 7, 8):  # a partial end (7 8 then 2) does not end the reasoning
        assert g.constraining is None and g.accept_token(tok)
    assert not g.is_terminated() and inner.seen == []
    assert g.accept_token(9) and g.constraining is inner and inner.seen == []
    g.accept_token(4)
    g.accept_token(5)
    assert inner.seen == [4, 5] and g.is_terminated()


def test_without_require_reasoning_the_grammar_holds_from_the_first_token():
    inner = Recorder()
    g = RequestGrammar(inner)
    assert g.constraining is inner
    g.accept_token(7)
    assert inner.seen == [7]


def test_a_reasoning_row_masks_nothing_and_the_grammar_row_is_masked(smol_tokenizer):
    backend = GrammarBackend(smol_tokenizer, 49152)
    try:
        compiled = backend.compile("regex", "[0-9]+").result(timeout=60)
        end = tuple(smol_tokenizer.encode("</think>", add_special_tokens=False))
        thinking, plain = backend.matcher(compiled, end), backend.matcher(compiled)
        bitmask = backend.bitmask_buffer(2)
        backend.fill_bitmask([thinking.constraining, plain.constraining], bitmask)
        allowed = lambda row: int(sum(bin(w & 0xFFFFFFFF).count("1") for w in bitmask[row].tolist()))  # noqa: E731
        assert allowed(0) == bitmask.shape[1] * 32  # still reasoning: every token
        assert 0 < allowed(1) < 1000  # digits only
        letter = smol_tokenizer.encode("a", add_special_tokens=False)[0]
        for tok in (letter, *end):  # reasoning may write anything, then closes
            assert thinking.accept_token(tok)
        backend.fill_bitmask([thinking.constraining], bitmask[:1])
        assert allowed(0) == allowed(1)  # now the grammar's mask
        digit = smol_tokenizer.encode("7", add_special_tokens=False)[0]
        assert thinking.accept_token(digit) and not thinking.accept_token(letter)
    finally:
        backend.close()

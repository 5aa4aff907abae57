"""GrammarBackend with the real SmolLM2 tokenizer: every kind compiles, results are cached,
xgrammar's errors come back readable, and a matcher walks a grammar to its end."""
from __future__ import annotations

import json

import pytest
import torch

from tandem.runtime.grammar.backend import GrammarBackend
from tandem.runtime.grammar.mask import GrammarMask


@pytest.fixture(scope="module")
def backend(smol_tokenizer):
    be = GrammarBackend(smol_tokenizer, 49152)
    yield be
    be.close()


STRUCTURAL_LEGACY = json.dumps({"type": "structural_tag", "triggers": ["<call>"], "structures": [
    {"begin": "<call>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}, "end": "</call>"}]})


@pytest.mark.parametrize("kind, text", [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    ("regex", r"\d{3}-\d{4}"),
    ("ebnf", 'root ::= "yes" | "no"'),
    ("structural_tag", STRUCTURAL_LEGACY),
])
def test_every_kind_compiles_and_is_cached(backend, kind, text):
    fut = backend.compile(kind, text)
    assert fut.result(timeout=60) is not None
    assert backend.compile(kind, text) is fut


@pytest.mark.parametrize("kind, text, fragment", [
    ("regex", "(unclosed", "parenthesis is not closed"),
    ("json_schema", '{"type": "nonsense"}', 'Unsupported type "nonsense"'),
    ("ebnf", 'root ::= "a" |', "EBNF parser error"),
])
def test_errors_are_xgrammars_message_without_its_prefix(backend, kind, text, fragment):
    exc = backend.compile(kind, text).exception(timeout=60)
    message = backend.error_message(exc)
    assert fragment in message and "/project/" not in message and not message.startswith("[")


def test_a_matcher_walks_to_the_end_and_the_mask_allows_only_the_grammar(backend, smol_tokenizer):
    matcher = backend.matcher(backend.compile("regex", "(?:yes|no)").result(timeout=60))
    mask = GrammarMask([1])
    mask.fill([matcher.constraining], backend, torch.device("cpu"))
    logits = torch.zeros(2, 49152)
    masked = mask.apply(logits)
    assert torch.isfinite(logits).all()  # the raw logits (and so the logprobs) are untouched
    assert torch.isfinite(masked[0]).all()  # an unconstrained row shares the batch
    allowed = set(torch.isfinite(masked[1]).nonzero().flatten().tolist())
    yes = smol_tokenizer.encode("yes", add_special_tokens=False)
    assert yes[0] in allowed and smol_tokenizer.encode("maybe", add_special_tokens=False)[0] not in allowed
    for tok in yes:
        assert matcher.accept_token(tok)
    assert not matcher.is_terminated() and matcher.accept_token(smol_tokenizer.eos_token_id)
    assert matcher.is_terminated()


def test_sglangs_any_json_schema_takes_any_json_value(backend, smol_tokenizer):
    """json_schema "$$ANY$$" (sglang.test.send_one --json sends it): xgrammar's built-in JSON
    grammar, so a bare array is allowed, where a schema would have wanted an object."""
    grammar = backend.compile("json_schema", "$$ANY$$").result(timeout=60)
    matcher = backend.matcher(grammar).constraining
    for tok in smol_tokenizer.encode("[1, 2]", add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert matcher.accept_token(smol_tokenizer.eos_token_id) and matcher.is_terminated()
    assert not backend.matcher(grammar).constraining.accept_token(smol_tokenizer.encode("x", add_special_tokens=False)[0])


def test_a_failed_fill_never_leaves_the_worker_waiting(backend):
    mask = GrammarMask([0])

    class Broken:
        @staticmethod
        def bitmask_buffer(rows):
            raise MemoryError("no room")

    with pytest.raises(MemoryError):
        mask.fill([None], Broken, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="filling the grammar mask failed: no room"):
        mask.apply(torch.zeros(1, 8))


def test_bitmask_buffers_alternate_and_reused_rows_allow_everything(backend):
    a, b, c = backend.bitmask_buffer(2), backend.bitmask_buffer(3), backend.bitmask_buffer(2)
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() == c.data_ptr()  # two buffers, in turn
    a.zero_()
    mask = GrammarMask([0, 1])
    backend.bitmask_buffer(1)  # the next fill gets buffer `a` again
    mask.fill([None, None], backend, torch.device("cpu"))  # finished rows: no stale bits
    assert torch.isfinite(mask.apply(torch.zeros(2, 49152))).all()

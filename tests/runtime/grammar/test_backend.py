"""GrammarBackend with the real SmolLM2 tokenizer: every kind compiles, results are cached,
xgrammar's errors come back readable, and a matcher walks a grammar to its end."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from tandem.runtime.grammar import backend as backend_module
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
    # a grammar that matches nothing used to fail its request at the first token, with a 500
    ("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), "matches no text"),
    ("regex", r"[^\s\S]", "matches no text: no token can start it"),
])
def test_errors_are_xgrammars_message_without_its_prefix(backend, kind, text, fragment):
    exc = backend.compile(kind, text).exception(timeout=60)
    message = backend.error_message(exc)
    assert fragment in message and "/project/" not in message and not message.startswith("[")


def test_a_matcher_walks_to_the_end_and_the_mask_allows_only_the_grammar(backend, smol_tokenizer):
    matcher = backend.matcher(backend.compile("regex", "(?:yes|no)").result(timeout=60))
    mask = GrammarMask([1])
    mask.fill([matcher], backend, torch.device("cpu"))
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
    matcher = backend.matcher(grammar)
    for tok in smol_tokenizer.encode("[1, 2]", add_special_tokens=False):
        assert matcher.accept_token(tok)
    assert matcher.accept_token(smol_tokenizer.eos_token_id) and matcher.is_terminated()
    assert not backend.matcher(grammar).accept_token(smol_tokenizer.encode("x", add_special_tokens=False)[0])


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


@pytest.mark.parametrize("tag", [
    {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a>"]},
    {"structures": [{"begin": "<a>", "schema": None, "end": "</a>"}], "triggers": ["<a>"]},
    {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                          "content": {"type": "json_schema"}}},
    {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "x"}, {"type": "json_schema", "json_schema": None}]}},
])
def test_a_structural_tag_without_a_schema_takes_any_json(backend, smol_tokenizer, tag):
    """SGLang's backend fills a missing or null schema with {} in both forms; before, a 400
    ("does not compile: 'schema'")."""
    matcher = backend.matcher(backend.compile("structural_tag", json.dumps(tag)).result(timeout=60))
    text = "x[1]" if tag.get("format", {}).get("type") == "sequence" else "<a>[1]</a>"
    for tok in smol_tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(tok), text


@pytest.mark.parametrize("at_least_one", [False, True])
def test_a_legacy_structural_tag_with_at_least_one_opens_with_a_tag(backend, smol_tokenizer, at_least_one):
    """SGLang sets the legacy form's at_least_one on xgrammar's triggered tags: text before the
    first tag is then refused. Before, the flag was dropped and free text always passed."""
    tag = {"structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}], "triggers": ["<a>"],
           "at_least_one": at_least_one}
    compiled = backend.compile("structural_tag", json.dumps(tag)).result(timeout=60)

    def accepts(text: str) -> bool:
        matcher = backend.matcher(compiled)
        return all(matcher.accept_token(tok) for tok in smol_tokenizer.encode(text, add_special_tokens=False))

    assert accepts('<a>{"k": 1}</a> done')
    assert accepts("free text") is not at_least_one


@pytest.mark.parametrize("tag, fragment", [
    ({"structures": [1], "triggers": ["<a>"]}, "structures[0] must be an object"),
    ({"structures": [{"begin": "<a>", "schema": {}}], "triggers": ["<a>"]}, "structures[0].end must be a string"),
    ({"structures": "x", "triggers": ["<a>"]}, "structures must be a list"),
    ({"structures": [], "triggers": ["<a>"], "at_least_one": "yes"}, "at_least_one must be a boolean"),
    ({"type": "structural_tag", "format": {"type": "nonsense"}}, "Invalid structural tag error"),
])
def test_a_malformed_structural_tag_names_what_is_wrong(backend, tag, fragment):
    message = backend.error_message(backend.compile("structural_tag", json.dumps(tag)).exception(timeout=60))
    assert fragment in message and "Check failed" not in message, message


def test_every_model_eos_id_ends_a_grammar(smol_tokenizer):
    """SGLang hands the model's EOS ids to xgrammar as its stop tokens: a model whose config lists
    another EOS than the tokenizer's (id 0 here) may end a complete grammar with it; xgrammar on
    its own takes only the tokenizer's eos_token and masked id 0."""
    be = GrammarBackend(smol_tokenizer, 49152, stop_token_ids=(0, smol_tokenizer.eos_token_id))
    try:
        matcher = be.matcher(be.compile("regex", "ab").result(timeout=60))
        for tok in smol_tokenizer.encode("ab", add_special_tokens=False):
            assert matcher.accept_token(tok)
        assert matcher.accept_token(0) and matcher.is_terminated()
    finally:
        be.close()


def test_releasing_a_grammar_cancels_a_compile_that_has_not_started(smol_tokenizer):
    be = GrammarBackend(smol_tokenizer, 49152)
    try:
        blockers = [threading.Event() for _ in range(be._pool.threads)]
        for ev in blockers:  # every compile thread busy until we let go
            be._pool.submit(ev.wait, 60)
        queued = be.compile("regex", "abandoned")
        be.release("regex", "abandoned")
        assert queued.cancelled()
        assert be.compile("regex", "abandoned") is not queued  # compiled afresh when asked again
        for ev in blockers:
            ev.set()
        done = be.compile("regex", "abandoned")
        assert done.result(timeout=60) is not None
        be.release("regex", "abandoned")  # a finished compile stays cached
        assert be.compile("regex", "abandoned") is done
    finally:
        be.close()


def test_a_quick_grammar_compiles_once_the_slow_one_ahead_of_it_is_given_up(smol_tokenizer):
    """One compile thread (the default): a trivial regex queued behind a compile that nobody waits
    for any more starts as soon as that one is released, while xgrammar still runs the old one."""
    be = GrammarBackend(smol_tokenizer, 49152)
    slow_done = threading.Event()
    try:
        assert be._pool.threads == 1
        slow = be._pool.submit(slow_done.wait, 60)
        quick = be.compile("regex", "a|b")
        assert not quick.done() and be._pool.busy() == (1, 0, 1)
        assert be._pool.abandon(slow)
        assert quick.result(timeout=10) is not None
        assert not slow_done.is_set()  # the slow one's thread was never waited for
    finally:
        slow_done.set()
        be.close()


def test_json_without_free_whitespace_has_sglangs_separators(smol_tokenizer):
    """--constrained-json-disable-any-whitespace: SGLang compiles with any_whitespace=False and
    xgrammar's default separators, so `{"a": 1, "b": 2}`; before, compact `{"a":1,"b":2}`."""
    be = GrammarBackend(smol_tokenizer, 49152, any_whitespace=False)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"]})
    try:
        compiled = be.compile("json_schema", schema).result(timeout=60)
        for text, ok in (('{"a": 1, "b": 2}', True), ('{"a":1,"b":2}', False), ('{ "a": 1, "b": 2}', False)):
            matcher = be.matcher(compiled)
            assert matcher.accept_string(text) is ok, text
    finally:
        be.close()


def test_the_cache_keeps_compiled_grammars_within_its_byte_bound(smol_tokenizer, monkeypatch):
    # bounded by count only, 1024 distinct schemas of 7.5 MB each (compiled) were all kept
    be = GrammarBackend(smol_tokenizer, 49152)
    try:
        patterns = [f"w{i}x[0-9]{{1,3}}" for i in range(4)]
        kept = [be.compile("regex", p) for p in patterns[:3]]
        one = max(f.result(timeout=60).memory_size_bytes for f in kept)
        assert be.compile("regex", patterns[0]) is kept[0]  # all three held; the first is now the most recent
        # a grammar is measured once done, so whether the newest counts yet is a race: the bound is
        # set where either way the least recent (patterns[1]) goes and patterns[0] stays
        monkeypatch.setattr(backend_module, "_CACHE_BYTES", 2 * one + one // 2)
        be.compile("regex", patterns[3]).result(timeout=60)
        assert be.compile("regex", patterns[0]) is kept[0]
        assert be.compile("regex", patterns[1]) is not kept[1]
    finally:
        be.close()

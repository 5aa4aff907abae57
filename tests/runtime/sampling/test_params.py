"""SamplingParams.from_request: defaults, conversions and every range rule."""

from __future__ import annotations

import math
import re
import pickle

import msgspec
import pytest

from tandem.runtime.sampling.params import FILL_CONTEXT, SamplingParams, params_from_request
from tandem.runtime.value_checks import ValidationError

VOCAB = 1000


def parse(d: object) -> SamplingParams:
    return params_from_request(d, VOCAB)


def test_defaults_match_sglang() -> None:
    p = parse({})
    assert p == SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k) == (
        128, 0, 1.0, 1.0, -1
    )  # fmt: skip
    assert (p.min_p, p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (
        0.0, 0.0, 0.0, 1.0
    )  # fmt: skip
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not (p.ignore_eos or p.no_stop_trim)
    assert p.n == 1 and p.sampling_seed is None and p.stream_interval is None
    assert parse(None) == p
    assert not p.is_greedy and not p.has_penalties


def test_default_lists_are_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


@pytest.mark.parametrize(
    "d, greedy",
    [({"temperature": 0}, True), ({"temperature": 1e-7}, True), ({"top_k": 1}, True),
     ({"temperature": 0.5}, False), ({"top_k": 2}, False)],
)  # fmt: skip
def test_is_greedy(d: dict, greedy: bool) -> None:
    assert parse(d).is_greedy is greedy


def test_null_means_default() -> None:
    assert parse({"temperature": None, "stop": None, "min_new_tokens": None}) == SamplingParams()


def test_null_max_new_tokens_fills_the_context_as_in_sglang() -> None:
    # SGLang: absent is 128, null is no limit of the client's (validation clamps it to the room left)
    assert parse({"max_new_tokens": None}).max_new_tokens == FILL_CONTEXT
    assert parse({}).max_new_tokens == 128


def test_seed_alias() -> None:
    assert parse({"seed": 7}).sampling_seed == 7
    assert parse({"sampling_seed": 7}).sampling_seed == 7
    assert parse({"seed": 7, "sampling_seed": 7}).sampling_seed == 7
    with pytest.raises(ValidationError, match=r"^sampling_params\.seed .*sampling_seed"):
        parse({"seed": 7, "sampling_seed": 8})
    with pytest.raises(ValidationError, match=r"^sampling_params\.seed must be a 64-bit"):
        parse({"seed": "7"})


def test_logit_bias_string_keys_become_ints() -> None:
    p = parse({"logit_bias": {"123": 5, "7": -2.5, 9: 1}})
    assert p.logit_bias == {123: 5.0, 7: -2.5, 9: 1.0}
    assert all(type(k) is int for k in p.logit_bias)
    assert parse({"logit_bias": {}}).logit_bias is None


def test_stop_token_ids_are_distinct_in_first_seen_order() -> None:
    # 1,000,000 repeats of one id made every decode step of the request scan them all (a 200-token
    # request beside it took 2.8 s instead of 0.2 s)
    assert parse({"stop_token_ids": [9, 5, None, 9, 5, 7] * 100_000}).stop_token_ids == [9, 5, 7]


def test_a_stop_regex_is_compiled_by_the_engine_the_scheduler_searches_with() -> None:
    # `re` compiles 200 nested groups; the `regex` module's parser recursed past the limit in the scheduler
    with pytest.raises(ValidationError, match="sampling_params.stop_regex is not a valid regular expression"):
        parse({"stop_regex": "(?:" * 200 + "a" + ")" * 200})


def test_stop_string_becomes_list() -> None:
    assert parse({"stop": "###"}).stop == ["###"]
    assert parse({"stop": ["a", "b"]}).stop == ["a", "b"]
    assert parse({"stop_regex": r"\d+"}).stop_regex == [r"\d+"]  # SGLang's: a pattern or a list


def test_one_constraint_per_request() -> None:
    assert parse({"regex": "a+"}).constraint == ("regex", "a+")
    assert parse({"json_schema": {"type": "object"}}).constraint == ("json_schema", '{"type":"object"}')
    assert parse({"json_schema": None, "regex": None}) == SamplingParams()  # null means "not given"
    assert parse({"json_schema": "$$ANY$$"}).constraint == ("json_schema", "$$ANY$$")  # SGLang's "any JSON"
    with pytest.raises(ValidationError, match=r"sampling_params.regex cannot be combined with json_schema"):
        parse({"json_schema": '{"type": "object"}', "regex": "a+"})


@pytest.mark.parametrize("field,value,fragment", [
    ("regex", "", "sampling_params.regex is an empty constraint"),
    ("ebnf", "", "sampling_params.ebnf is an empty constraint"),
    ("json_schema", "  ", "sampling_params.json_schema is an empty constraint"),
    ("choice", [], "sampling_params.choice is an empty constraint"),
    ("choice", ["a", ""], r"sampling_params.choice\[1\] must be a non-empty string"),
    ("choice", "a", "sampling_params.choice must be a list of strings"),
    ("json_schema", "{not json", "sampling_params.json_schema is not valid JSON"),
    ("json_schema", "[1]", "sampling_params.json_schema must be a JSON object"),
    ("structural_tag", "true", "sampling_params.structural_tag must be a JSON object"),
    ("regex", 5, "sampling_params.regex must be a string"),
])
def test_bad_constraints_name_the_field(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        parse({field: value})


@pytest.mark.parametrize("field, text", ids=["json_schema", "structural_tag"], argvalues=[
    ("json_schema", '{"a":' * 50_000 + "1" + "}" * 50_000),  # orjson 3.8 recursed this deep and crashed (pyproject pins >=3.10)
    ("structural_tag", "[" * 1025 + "]" * 1025),
])
def test_constraint_text_nested_too_deep_is_refused(field: str, text: str) -> None:
    with pytest.raises(ValidationError, match=f"sampling_params.{field} is not valid JSON: .*depth.* exceeded"):
        parse({field: text})


def test_choice_is_an_alternation_of_escaped_literals() -> None:
    choices = ["a.b", "(x)", "1+1", "c|d", "[e]", "f\\g", "plain"]
    pattern = parse({"choice": choices}).regex
    assert pattern is not None and parse({"choice": choices}).constraint == ("regex", pattern)
    for c in choices:
        assert re.fullmatch(pattern, c)
    for near_miss in ["axb", "x", "11", "c", "e", "plainx", "a.b|(x)"]:
        assert not re.fullmatch(pattern, near_miss)


def test_constraints_are_a_400_when_the_backend_is_off() -> None:
    with pytest.raises(ValidationError, match="sampling_params.choice needs guided decoding"):
        params_from_request({"choice": ["a"]}, VOCAB, guided_decoding=False)
    assert params_from_request({"regex": None}, VOCAB, guided_decoding=False) == SamplingParams()


@pytest.mark.parametrize("top_k, taken", [(0, -1), (-2, -1), (5, 5), (VOCAB, -1)])
def test_greedy_temperature_overrides_top_k_as_in_sglang(top_k: int, taken: int) -> None:
    # SGLang's SamplingParams turns temperature < 1e-6 into top_k 1 before verify() checks top_k
    p = parse({"temperature": 0, "top_k": top_k})
    assert p.is_greedy and p.top_k == taken


def test_null_stop_token_ids_are_dropped_as_in_sglang() -> None:
    assert parse({"stop_token_ids": [None, 7, None]}).stop_token_ids == [7]


def test_top_k_covering_vocab_means_all() -> None:
    assert parse({"top_k": VOCAB}).top_k == -1
    assert parse({"top_k": 50}).top_k == 50


def test_roundtrips_through_msgpack() -> None:
    p = parse({"logit_bias": {"3": 1.0}, "stop": "x", "seed": 1, "temperature": 0.3})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


def test_error_is_picklable_and_structured() -> None:
    with pytest.raises(ValidationError) as info:
        parse({"temperature": -1})
    e = info.value
    assert (e.field, e.message) == ("sampling_params.temperature", "must be >= 0, got -1")
    assert str(e) == "sampling_params.temperature must be >= 0, got -1"
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) and isinstance(e, ValueError)


def test_field_prefix_for_batch_items() -> None:
    with pytest.raises(ValidationError, match=r"^sampling_params\[3\]\.top_p "):
        params_from_request({"top_p": 2}, VOCAB, field="sampling_params[3]")


BAD = [
    # (sampling_params, field named, message fragment)
    ([1], "sampling_params", "must be an object"),
    ({"max_tokens": 5}, "sampling_params.max_tokens", "not a known sampling parameter"),
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens", ">= 0, got -1"),
    ({"max_new_tokens": 1.5}, "sampling_params.max_new_tokens", "must be an integer, got float"),
    ({"max_new_tokens": True}, "sampling_params.max_new_tokens", "must be an integer, got bool"),
    ({"max_new_tokens": 2**64}, "sampling_params.max_new_tokens", "64-bit"),
    ({"min_new_tokens": -2}, "sampling_params.min_new_tokens", ">= 0"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, "sampling_params.min_new_tokens",
     "<= max_new_tokens (8), got 9"),
    ({"temperature": -1}, "sampling_params.temperature", "must be >= 0, got -1"),
    ({"temperature": math.nan}, "sampling_params.temperature", "finite"),
    ({"temperature": math.inf}, "sampling_params.temperature", "finite"),
    ({"temperature": 10**400}, "sampling_params.temperature", "finite"),
    ({"temperature": "0"}, "sampling_params.temperature", "must be a number, got str"),
    ({"temperature": False}, "sampling_params.temperature", "must be a number, got bool"),
    ({"top_p": 0}, "sampling_params.top_p", "(0, 1], got 0"),
    ({"top_p": 1.01}, "sampling_params.top_p", "(0, 1]"),
    ({"top_k": 0}, "sampling_params.top_k", "-1 (all) or >= 1, got 0"),
    ({"top_k": -2}, "sampling_params.top_k", "-1 (all) or >= 1"),
    ({"min_p": 1.5}, "sampling_params.min_p", "[0, 1]"),
    ({"min_p": -0.1}, "sampling_params.min_p", "[0, 1]"),
    ({"frequency_penalty": 2.5}, "sampling_params.frequency_penalty", "[-2, 2], got 2.5"),
    ({"presence_penalty": -3}, "sampling_params.presence_penalty", "[-2, 2], got -3"),
    ({"repetition_penalty": 0}, "sampling_params.repetition_penalty", "(0, 2], got 0"),
    ({"repetition_penalty": 2.1}, "sampling_params.repetition_penalty", "(0, 2]"),
    ({"stop": 5}, "sampling_params.stop", "string or a list of strings"),
    ({"stop": ["a", 1]}, "sampling_params.stop[1]", "must be a string"),
    ({"stop": ["a", ""]}, "sampling_params.stop[1]", "must not be empty"),
    ({"stop": ["x"] * 33}, "sampling_params.stop", "33 entries, at most 32"),
    ({"stop": ""}, "sampling_params.stop", "must not be empty"),  # a bare string is named as sent
    ({"stop_regex": 5}, "sampling_params.stop_regex", "string or a list of strings"),
    ({"stop_regex": ["a", "(x"]}, "sampling_params.stop_regex[1]", "not a valid regular expression: missing )"),
    ({"stop_regex": ["a", "x*"]}, "sampling_params.stop_regex[1]", "matches the empty string"),
    ({"stop_regex": "(x"}, "sampling_params.stop_regex", "not a valid regular expression"),
    ({"top_k": 0, "temperature": 0.5}, "sampling_params.top_k", "-1 (all) or >= 1, got 0"),
    ({"stop_token_ids": 3}, "sampling_params.stop_token_ids", "list of integers"),
    ({"stop_token_ids": [1, VOCAB]}, "sampling_params.stop_token_ids[1]", "[0, 1000), got 1000"),
    ({"stop_token_ids": [-1]}, "sampling_params.stop_token_ids[0]", "[0, 1000)"),
    ({"stop_token_ids": [True]}, "sampling_params.stop_token_ids[0]", "integer token id"),
    ({"ignore_eos": 1}, "sampling_params.ignore_eos", "must be a boolean, got int"),
    ({"skip_special_tokens": "yes"}, "sampling_params.skip_special_tokens", "boolean"),
    ({"spaces_between_special_tokens": 0}, "sampling_params.spaces_between_special_tokens",
     "boolean"),
    ({"no_stop_trim": []}, "sampling_params.no_stop_trim", "boolean"),
    ({"logit_bias": [1, 2]}, "sampling_params.logit_bias", "token id -> bias"),
    ({"logit_bias": {"abc": 1}}, "sampling_params.logit_bias['abc']", "integer token id"),
    ({"logit_bias": {"5000": 1}}, "sampling_params.logit_bias['5000']", "[0, 1000), got 5000"),
    ({"logit_bias": {"-1": 1}}, "sampling_params.logit_bias['-1']", "[0, 1000)"),
    ({"logit_bias": {"5": "1"}}, "sampling_params.logit_bias['5']", "finite float32 number"),
    ({"logit_bias": {"5": math.inf}}, "sampling_params.logit_bias['5']", "finite float32 number"),
    ({"n": 0}, "sampling_params.n", "[1, 64], got 0"),
    ({"n": 65}, "sampling_params.n", "[1, 64], got 65"),
    ({"sampling_seed": 2**64}, "sampling_params.sampling_seed", "64-bit"),
    ({"sampling_seed": 1.0}, "sampling_params.sampling_seed", "64-bit"),
    ({"stream_interval": 0}, "sampling_params.stream_interval", ">= 1, got 0"),
]  # fmt: skip


@pytest.mark.parametrize("d, field, fragment", BAD, ids=[b[1] for b in BAD])
def test_rejects(d: object, field: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        parse(d)
    assert info.value.field == field
    assert str(info.value).startswith(field + " ")
    assert fragment in info.value.message


@pytest.mark.parametrize(
    "d",
    [{"temperature": 0}, {"top_p": 1}, {"top_p": 1e-9}, {"min_p": 1}, {"repetition_penalty": 2},
     {"frequency_penalty": -2}, {"presence_penalty": 2}, {"n": 64}, {"max_new_tokens": 0},
     {"min_new_tokens": 128}, {"stop": ["x"] * 32}, {"stop_token_ids": [0, VOCAB - 1]},
     {"sampling_seed": -(2**63)}, {"stream_interval": 1}],
)  # fmt: skip
def test_accepts_boundaries(d: dict) -> None:
    (key, value), = d.items()
    assert getattr(parse(d), key) == value  # taken as given, not clamped


@pytest.mark.parametrize("d, field, fragment", [
    ({"logit_bias": {"5": 3.41e38}}, "logit_bias['5']", "finite float32"),
    ({"temperature": 1e39}, "temperature", "finite float32"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty", "got 1e-300 (0 as a float32)"),
    ({"top_p": 1e-46}, "top_p", "(0 as a float32)"),
])
def test_values_are_checked_as_the_float32_the_device_sees(d, field, fragment) -> None:
    with pytest.raises(ValidationError, match=re.escape(f"sampling_params.{field}")) as err:
        parse(d)
    assert fragment in str(err.value)


def test_values_are_kept_as_given_when_float32_can_hold_them() -> None:
    p = parse({"logit_bias": {"5": 3.4e38}, "temperature": 0.1})
    assert p.logit_bias[5] == 3.4e38 and p.temperature == 0.1


@pytest.mark.parametrize("field", ["seed", "logit_bias", "stop", "stop_token_ids", "max_new_tokens"])
def test_deeply_nested_values_are_a_400_not_a_recursion_error(field) -> None:
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    value = {"1": deep} if field == "logit_bias" else deep
    with pytest.raises(ValidationError, match=f"sampling_params.{field}"):
        parse({field: value})


def test_max_thinking_tokens():
    assert parse({"max_thinking_tokens": 7}).max_thinking_tokens == 7
    with pytest.raises(ValidationError, match="sampling_params.max_thinking_tokens must be >= 0"):
        parse({"max_thinking_tokens": -1})
    assert parse({"max_thinking_tokens": 3, "regex": "a+"}).constraint == ("regex", "a+")  # see require_reasoning


def test_an_integer_past_64_bits_is_named_as_one() -> None:
    """orjson reads an integer beyond 64 bits as a float: the error says what the client sent."""
    import orjson

    big = orjson.loads(b'{"n": 1180591620717411303424}')["n"]
    with pytest.raises(ValidationError, match=r"^sampling_params\.n must be an integer, got an integer beyond 64 bits"):
        parse({"n": big})

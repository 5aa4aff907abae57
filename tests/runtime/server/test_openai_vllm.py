"""vLLM's OpenAI extensions (runtime/server/openai_vllm.py): structured_outputs and
thinking_token_budget map onto tandem's constraints and thinking budget; the extensions it does
not implement are a 400 naming the field, never a 200 that ignored them."""
from __future__ import annotations

import pytest

from tandem.runtime.server.openai_vllm import apply_vllm_fields
from tandem.runtime.value_checks import ValidationError


def mapped(body: dict) -> tuple[dict, dict]:
    sp, renames = {}, {}
    apply_vllm_fields(body, sp, renames)
    return sp, renames


@pytest.mark.parametrize("so, want", [
    ({"json": {"type": "object"}}, {"json_schema": '{"type":"object"}'}),
    ({"json": '{"type": "string"}'}, {"json_schema": '{"type": "string"}'}),
    ({"regex": "[a-z]+", "choice": None}, {"regex": "[a-z]+"}),
    ({"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"grammar": 'root ::= "x"'}, {"ebnf": 'root ::= "x"'}),
])
def test_structured_outputs_map_onto_the_constraints(so, want):
    sp, renames = mapped({"structured_outputs": so})
    assert sp == want and renames == {kind: f"structured_outputs.{next(k for k in so if so[k] is not None)}"
                                      for kind in want}


def test_thinking_token_budget_is_max_thinking_tokens():
    assert mapped({"thinking_token_budget": 64}) == ({"max_thinking_tokens": 64},
                                                     {"max_thinking_tokens": "thinking_token_budget"})


@pytest.mark.parametrize("body, field", [
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ({"include_reasoning": False}, "include_reasoning"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
])
def test_what_tandem_cannot_honour_is_refused_naming_the_field(body, field):
    with pytest.raises(ValidationError) as err:
        mapped(body)
    assert err.value.field == field


def test_vllms_defaults_pass():
    defaults = {"prompt_logprobs": None, "bad_words": [], "use_beam_search": False, "include_reasoning": True,
                "return_tokens_as_token_ids": False}
    assert mapped(defaults) == ({}, {})


@pytest.mark.timeout(300)
def test_a_vllm_client_gets_its_choice_constraint_and_its_400(tiny_server):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    got = tiny_server.post("/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] in ("yes", "no")
    bad = tiny_server.post("/v1/chat/completions", {**body, "structured_outputs": None, "use_beam_search": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"
    both = tiny_server.post("/v1/chat/completions", {**body, "regex": "a+"})
    assert both.status_code == 400 and "structured_outputs.choice" in both.text

"""Guided decoding end to end: SmolLM2 under JSON schema, regex, choice, EBNF and structural-tag
constraints; constrained and unconstrained requests in one batch agree across overlap,
chunked prefill and forced retraction; bad grammars are a 400; compiling never blocks others."""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(600)

PROFILE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "color", "tags", "address"],
}
GREEDY = {"temperature": 0}


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_json_schema_outputs_parse_and_validate(smol_server):
    prompts = [_chat(f"Invent person number {i}: name, age, favourite color, a few tags and an address, as JSON.")
               for i in range(20)]
    outs = smol_server.generate({"text": prompts, "sampling_params": {
        **GREEDY, "max_new_tokens": 200, "json_schema": json.dumps(PROFILE_SCHEMA)}})
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), PROFILE_SCHEMA)


def test_regex_choice_ebnf_and_structural_tag(smol_server):
    phone = smol_server.generate({"text": _chat("What is your phone number?"), "sampling_params": {
        **GREEDY, "max_new_tokens": 32, "regex": r"\d{3}-\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", phone["text"]), phone
    choices = ["yes", "no", "a.b", "(x)"]
    for question in ("Is the sky green?", "Say a.b or (x).", "Write a poem about the sea."):
        out = smol_server.generate({"text": _chat(question), "sampling_params": {
            **GREEDY, "max_new_tokens": 16, "choice": choices}})
        assert out["text"] in choices, out
    arithmetic = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= num ("*" num)*\nnum ::= [1-9] [0-9]?'
    expr = smol_server.generate({"text": _chat("Write an arithmetic expression."), "sampling_params": {
        **GREEDY, "max_new_tokens": 32, "ebnf": arithmetic}})
    assert re.fullmatch(r"[1-9][0-9]?(\*[1-9][0-9]?)*(\+[1-9][0-9]?(\*[1-9][0-9]?)*)*", expr["text"]), expr
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>", "end": "</call>", "content": {
        "type": "json_schema", "json_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                                          "maxLength": 16}},
                                               "required": ["city"]}}}}
    call = smol_server.generate({"text": _chat("Call the weather tool for Paris."), "sampling_params": {
        **GREEDY, "max_new_tokens": 48, "structural_tag": json.dumps(tag)}})
    match = re.fullmatch(r"<call>(.*)</call>", call["text"], re.S)
    assert match and "city" in json.loads(match.group(1)), call


MIXED = {
    "input_ids": [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41] * 40],
    "return_logprob": True,
    "sampling_params": [
        {**GREEDY, "max_new_tokens": 24, "json_schema": json.dumps({"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}}, "required": ["a", "b"]})},
        {**GREEDY, "max_new_tokens": 24, "ignore_eos": True},
        {"temperature": 1.0, "seed": 7, "max_new_tokens": 16, "regex": "[a-z]{3,12}", "n": 2},
        {**GREEDY, "max_new_tokens": 8, "choice": ["alpha", "beta", "gamma"]},
    ],
}


def test_constrained_and_unconstrained_agree_across_overlap_chunking_and_retraction(servers):
    results = {}
    for name in ("tiny", "tiny_sequential_chunked_retract", "tiny_overlap_chunked_retract"):
        out = servers(name).generate(MIXED)
        results[name] = [(o["output_ids"], [t[0] for t in o["meta_info"]["output_token_logprobs"]]) for o in out]
    ids = {name: [r[0] for r in rs] for name, rs in results.items()}
    assert ids["tiny"] == ids["tiny_sequential_chunked_retract"] == ids["tiny_overlap_chunked_retract"]
    # logprobs are of the masked distribution (SGLang), but a sampled token is always allowed: finite
    for name, rs in results.items():
        assert all(lp is not None and lp > -1e30 for _, lps in rs for lp in lps), name
    assert len(results["tiny"]) == 5


@pytest.mark.parametrize("sp, field, fragment", [
    ({"json_schema": '{"type": "nonsense"}'}, "json_schema", 'does not compile: Unsupported type "nonsense"'),
    ({"json_schema": "{not json"}, "json_schema", "is not valid JSON"),
    ({"regex": "(unclosed"}, "regex", "does not compile: Regex parsing error"),
    ({"ebnf": 'root ::= "a" |'}, "ebnf", "does not compile: EBNF parser error"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf", "cannot be combined with regex"),
    ({"choice": []}, "choice", "is an empty constraint"),
    ({"regex": ""}, "regex", "is an empty constraint"),
    ({"regex": "a" * 131073}, "regex", "is 131073 bytes, over --max-grammar-bytes (131072)"),
])
def test_bad_constraints_are_a_400_and_leave_nothing_behind(tiny_server, sp, field, fragment):
    resp = tiny_server.post("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, **sp}})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert f"sampling_params.{field}" in message and fragment in message, message
    assert tiny_server.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})["output_ids"]
    assert_no_leaks(tiny_server)


@pytest.mark.parametrize("sp, texts", [({"regex": "ab", **GREEDY}, {"ab"}),
                                      ({"choice": ["yes", "no"], "temperature": 0.7, "seed": 1}, {"yes", "no"})])
def test_a_grammar_ends_the_request_before_min_new_tokens(tiny_server, sp, texts):
    """min_new_tokens bans EOS, but a grammar that has ended allows nothing else: the constraint
    wins and the request stops at its end (before, every token was banned: a 500)."""
    out = tiny_server.generate({"text": "a b c", "sampling_params": {"max_new_tokens": 20, "min_new_tokens": 6,
                                                                     "n": 2, **sp}})
    for choice in out:
        assert choice["meta_info"]["finish_reason"]["type"] == "stop", choice
        assert choice["text"] in texts
    assert_no_leaks(tiny_server)


def test_a_slow_compile_does_not_hold_up_other_requests(tiny_server):
    slow = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{2,8}"} for i in range(600)},
            "required": [f"f{i}" for i in range(600)]}  # seconds to compile on a CPU
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("slow", tiny_server.post("/generate", {
        "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1, "json_schema": json.dumps(slow)}})))
    thread.start()
    deadline = time.monotonic() + 30
    while tiny_server.info()["num_grammar_queue_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    quick = tiny_server.generate({"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}})
    still_compiling = tiny_server.info()["num_grammar_queue_reqs"]
    thread.join(120)
    assert len(quick["output_ids"]) == 16
    assert still_compiling == 1  # the other request ran to its end while the grammar was compiling
    assert result["slow"].status_code == 200

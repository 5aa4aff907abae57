"""OpenAI response_format -> the native constraint /generate takes, without a server: the
structural_tag type in SGLang's two forms, its shape errors naming the field, and /v1/responses,
whose text.format has no structural_tag."""
from __future__ import annotations

import json

import pytest

from tandem.runtime.server import openai as oa
from tandem.runtime.server.openai_response_format import response_format_constraint
from tandem.runtime.server.responses_api import responses_request
from tandem.runtime.value_checks import ValidationError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LEGACY = {"type": "structural_tag", "structures": [{"begin": "<call>", "schema": SCHEMA, "end": "</call>"}],
          "triggers": ["<call>"]}
MESSAGES = [{"role": "user", "content": "x"}]


def _chat(body: dict) -> oa.OpenAIRequest:
    return oa.chat_request({"messages": MESSAGES, **body}, "served", lambda messages, kw: "t")


def _completion(body: dict) -> oa.OpenAIRequest:
    return oa.completion_request({"prompt": "a", **body}, "served")


@pytest.mark.parametrize("make", [_chat, _completion])
def test_a_legacy_structural_tag_becomes_the_tag_sglang_passes(make):
    """SGLang's model_dump of its LegacyStructuralTagResponseFormat: at_least_one defaults to
    false, a field it has no model for is dropped. Before, any structural_tag was a 400."""
    req = make({"response_format": {**LEGACY, "unknown": 1,
                                    "structures": [{**LEGACY["structures"][0], "name": "weather"},
                                                   {"begin": "<x>", "end": "</x>"}]}})
    sp = req.native["sampling_params"]
    assert json.loads(sp["structural_tag"]) == {
        "type": "structural_tag", "triggers": ["<call>"], "at_least_one": False,
        "structures": [{"begin": "<call>", "schema": SCHEMA, "end": "</call>"},
                       {"begin": "<x>", "schema": None, "end": "</x>"}]}
    assert "json_schema" not in sp
    # a compile error and a clash are named as the client sent the tag
    assert req.rename(ValidationError("sampling_params.structural_tag", "does not compile: x")).field \
        == "response_format"
    clash = req.rename(ValidationError("sampling_params.regex", "cannot be combined with structural_tag"))
    assert clash.message == "cannot be combined with response_format"


def test_at_least_one_and_xgrammars_format_pass_through():
    tag = response_format_constraint({**LEGACY, "at_least_one": True})
    assert tag[0] == "structural_tag" and json.loads(tag[1])["at_least_one"] is True
    fmt = {"type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "json_schema", "json_schema": SCHEMA}}
    kind, text = response_format_constraint({"type": "structural_tag", "format": fmt, "extra": 2})
    assert (kind, json.loads(text)) == ("structural_tag", {"type": "structural_tag", "format": fmt})


def test_the_other_types_are_unchanged():
    assert response_format_constraint({"type": "text"}) is None
    assert response_format_constraint({"type": "json_object"}) == ("json_schema", '{"type": "object"}')
    assert response_format_constraint({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}) \
        == ("json_schema", json.dumps(SCHEMA, separators=(",", ":")))


@pytest.mark.parametrize("fmt, field, fragment", [
    ({"type": "xml"}, "response_format", '"structural_tag"'),
    ({"type": "structural_tag"}, "response_format", "needs \"structures\" and \"triggers\""),
    ({**LEGACY, "structures": {"begin": "<a>"}}, "response_format.structures", "must be a list"),
    ({**LEGACY, "triggers": None}, "response_format.triggers", "is required"),
    ({**LEGACY, "triggers": ["<call>", 3]}, "response_format.triggers[1]", "must be a string"),
    ({**LEGACY, "at_least_one": "yes"}, "response_format.at_least_one", "must be a boolean"),
    ({**LEGACY, "structures": ["<a>"]}, "response_format.structures[0]", "must be an object"),
    ({**LEGACY, "structures": [{"schema": SCHEMA, "end": "</a>"}]}, "response_format.structures[0].begin",
     "is required"),
    ({**LEGACY, "structures": [LEGACY["structures"][0], {"begin": "<a>", "end": 5}]},
     "response_format.structures[1].end", "a string"),
    ({**LEGACY, "structures": [{"begin": "<a>", "schema": "{}", "end": "</a>"}]},
     "response_format.structures[0].schema", "a JSON schema object"),
    ({"type": "structural_tag", "format": "tag"}, "response_format.format", "an xgrammar format"),
    ({"type": "structural_tag", "format": {"begin": "<a>"}}, "response_format.format", "\"type\""),
    ({**LEGACY, "format": {"type": "any_text"}}, "response_format.format", "cannot be combined with structures"),
])
def test_a_malformed_structural_tag_names_the_field(fmt, field, fragment):
    for make in (_chat, _completion):
        with pytest.raises(ValidationError) as err:
            make({"response_format": fmt})
        assert err.value.field == field and fragment in err.value.message, err.value


@pytest.mark.parametrize("fmt, field", [
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": "DEEP"}}, "response_format.json_schema.schema"),
    ({**LEGACY, "structures": [{"begin": "<a>", "schema": "DEEP", "end": "</a>"}]}, "response_format"),
    ({"type": "structural_tag", "format": {"type": "tag", "content": "DEEP"}}, "response_format"),
])
def test_a_format_nested_deeper_than_json_output_allows_is_a_400(fmt, field):
    """The body parser takes 1024 levels, orjson writes at most 255: a schema nested 300 deep was a
    TypeError out of the route, a 500."""
    deep: dict = {"type": "object"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    fmt = json.loads(json.dumps(fmt).replace('"DEEP"', json.dumps(deep)))
    for make in (_chat, _completion):
        with pytest.raises(ValidationError) as err:
            make({"response_format": fmt})
        assert err.value.field == field and "cannot be encoded as JSON" in err.value.message, err.value


def test_the_responses_text_format_has_no_structural_tag():
    """SGLang's ResponsesRequest takes OpenAI's ResponseTextConfig: text, json_object or json_schema."""
    for fmt in (LEGACY, {"type": "xml"}, "json_object"):
        with pytest.raises(ValidationError) as err:
            responses_request({"input": "x", "text": {"format": fmt}}, "served", lambda m, kw: "t")
        assert err.value.field == "text.format" and "structural_tag" not in err.value.message, err.value
    req = responses_request({"input": "x", "text": {"format": {"type": "json_object"}}}, "served", lambda m, kw: "t")
    assert req.native["sampling_params"]["json_schema"] == '{"type": "object"}'

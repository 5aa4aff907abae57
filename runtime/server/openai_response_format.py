"""OpenAI's `response_format` as one native constraint, as SGLang's serving_chat and
serving_completions build it: `json_object` is any JSON object, `json_schema` its schema, and
`structural_tag` the tag itself as JSON text (SGLang passes the parsed request's model_dump).

A structural tag comes in SGLang's two forms: the legacy `structures` (begin, schema, end) with
`triggers` and `at_least_one`, and xgrammar's `format`. The legacy form's shape is checked here, so
its errors name the field (`response_format.structures[0].begin`); what only the compiler can
judge (a `format` tree, a begin no trigger starts) comes back from the grammar compile, named
`response_format`. Fields SGLang's models do not have are dropped from the text, as its dump drops
them, so equal tags share one compiled grammar.
"""
from __future__ import annotations

from typing import Any

from tandem.runtime.value_checks import ValidationError, json_text

TYPES = ("text", "json_object", "json_schema", "structural_tag")


def response_format_constraint(fmt: Any) -> tuple[str, str] | None:
    """(native sampling param, its text) for `fmt`; None for plain text."""
    if not isinstance(fmt, dict) or fmt.get("type") not in TYPES:
        raise ValidationError("response_format", "must be {\"type\": \"" + "\" | \"".join(TYPES) + "\"}")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "json_schema":  # SGLang also takes the schema at the top level
        spec = fmt.get("json_schema", {"schema": fmt.get("schema")})
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValidationError("response_format.json_schema.schema", "is required: a JSON schema object")
        return "json_schema", json_text("response_format.json_schema.schema", spec["schema"])
    return "structural_tag", json_text("response_format", _structural_tag(fmt))


def _structural_tag(fmt: dict) -> dict[str, Any]:
    if fmt.get("structures") is not None:
        if fmt.get("format") is not None:
            raise ValidationError("response_format.format", "cannot be combined with structures; give one form")
        return _legacy_tag(fmt)
    if fmt.get("format") is None:
        raise ValidationError("response_format", "a structural_tag needs \"structures\" and \"triggers\" "
                                                 "(the legacy form) or \"format\"")
    if not isinstance(fmt["format"], dict) or not isinstance(fmt["format"].get("type"), str):
        raise ValidationError("response_format.format", "must be an object with a \"type\" (an xgrammar format)")
    return {"type": "structural_tag", "format": fmt["format"]}


def _legacy_tag(fmt: dict) -> dict[str, Any]:
    structures, triggers = fmt["structures"], fmt.get("triggers")
    if not isinstance(structures, list):
        raise ValidationError("response_format.structures", "must be a list of {begin, schema, end} objects")
    if not isinstance(triggers, list):
        raise ValidationError("response_format.triggers", "is required: a list of strings")
    for i, trigger in enumerate(triggers):
        if not isinstance(trigger, str):
            raise ValidationError(f"response_format.triggers[{i}]", "must be a string")
    at_least_one = fmt.get("at_least_one", False)
    if not isinstance(at_least_one, bool):
        raise ValidationError("response_format.at_least_one", f"must be a boolean, got {at_least_one!r}")
    return {"type": "structural_tag", "structures": [_structure(i, s) for i, s in enumerate(structures)],
            "triggers": triggers, "at_least_one": at_least_one}


def _structure(i: int, s: Any) -> dict[str, Any]:
    where = f"response_format.structures[{i}]"
    if not isinstance(s, dict):
        raise ValidationError(where, "must be an object with begin, schema and end")
    for key in ("begin", "end"):
        if not isinstance(s.get(key), str):
            raise ValidationError(f"{where}.{key}", "is required: a string")
    schema = s.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValidationError(f"{where}.schema", "must be a JSON schema object or null (any JSON)")
    return {"begin": s["begin"], "schema": schema, "end": s["end"]}

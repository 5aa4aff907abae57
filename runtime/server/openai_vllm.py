"""vLLM's extensions of the OpenAI request that clients written for vLLM send: the ones tandem can
honour map onto its own sampling parameters, the others are a 400 naming the field (a 200 with the
field ignored would be a wrong answer)."""
from __future__ import annotations

from typing import Any

from tandem.runtime.value_checks import ValidationError, json_text, type_name

# structured_outputs' keys -> tandem's constraint (vLLM's StructuredOutputsParams)
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf",
               "structural_tag": "structural_tag"}
# refused unless absent or at vLLM's default (what a client sends for "not used")
_REFUSED_UNLESS = {"prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [], "truncate_prompt_tokens": None,
                   "use_beam_search": False, "return_tokens_as_token_ids": False, "include_reasoning": True}


def apply_vllm_fields(body: dict, sp: dict[str, Any], renames: dict[str, str]) -> None:
    """Maps `structured_outputs` and `thinking_token_budget` into the sampling params `sp` (errors
    renamed to vLLM's fields through `renames`); refuses the extensions tandem does not implement."""
    for name, default in _REFUSED_UNLESS.items():
        if body.get(name) is not None and body[name] != default:
            raise ValidationError(name, "is vLLM's extension and is not supported by this server")
    if body.get("thinking_token_budget") is not None:
        sp["max_thinking_tokens"], renames["max_thinking_tokens"] = body["thinking_token_budget"], "thinking_token_budget"
    so = body.get("structured_outputs")
    if so is None:
        return
    if not isinstance(so, dict):
        raise ValidationError("structured_outputs", f"must be an object, got {type_name(so)}")
    given = [key for key, value in so.items() if value is not None]
    for key in given:
        if key not in _STRUCTURED:
            raise ValidationError(f"structured_outputs.{key}", "is not supported by this server (it takes "
                                  + ", ".join(_STRUCTURED) + ")")
    if len(given) != 1:
        raise ValidationError("structured_outputs", f"must set exactly one of {', '.join(_STRUCTURED)}")
    key = given[0]
    kind, value = _STRUCTURED[key], so[key]
    if kind in ("json_schema", "structural_tag") and not isinstance(value, str):
        value = json_text(f"structured_outputs.{key}", value)
    if kind in sp:
        raise ValidationError(f"structured_outputs.{key}", f"cannot be combined with {renames.get(kind, kind)}")
    sp[kind], renames[kind] = value, f"structured_outputs.{key}"

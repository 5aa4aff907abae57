"""SGLang's /tokenize and /detokenize (and their /v1/ forms): text to ids and back with the served
tokenizer. A body is checked field by field (a 400 names the field, an unknown field included);
the work runs off the event loop, where a long text would stall every stream."""
from __future__ import annotations

import asyncio
from typing import Any

from tandem.runtime.value_checks import ValidationError, check_fields, is_int, type_name

TOKENIZE_FIELDS = ("model", "prompt", "add_special_tokens")
DETOKENIZE_FIELDS = ("model", "tokens", "skip_special_tokens")


async def tokenize(tm: Any, body: Any) -> dict[str, Any]:
    """{"prompt": str | [str], "add_special_tokens": true} -> {"tokens", "count", "max_model_len"},
    a list of each for a list of prompts; max_model_len is the served context length."""
    _check_fields(body, TOKENIZE_FIELDS)
    prompt = body.get("prompt")
    single = isinstance(prompt, str)
    if not single and not (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)):
        raise ValidationError("prompt", f"must be a string or a list of strings, got {type_name(prompt)}")
    add_special = _flag(body, "add_special_tokens", True)
    texts = [prompt] if single else prompt
    ids = await asyncio.get_running_loop().run_in_executor(
        None, lambda: [list(tm.tokenizer.encode(t, add_special_tokens=add_special)) for t in texts])
    context = tm.model_info["context_len"]
    if single:
        return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": context}
    return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": context}


async def detokenize(tm: Any, body: Any) -> dict[str, Any]:
    """{"tokens": [int] | [[int]], "skip_special_tokens": true} -> {"text": str | [str]}."""
    _check_fields(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ValidationError("tokens", f"must be a list of token ids or a list of such lists, got {type_name(tokens)}")
    single = not tokens or not isinstance(tokens[0], list)
    lists = [tokens] if single else tokens
    vocab = tm.model_info["vocab_size"]
    for i, ids in enumerate(lists):
        where = "tokens" if single else f"tokens[{i}]"
        if not isinstance(ids, list):
            raise ValidationError(where, f"must be a list of token ids, got {type_name(ids)}")
        for j, t in enumerate(ids):
            if not is_int(t) or not 0 <= t < vocab:
                raise ValidationError(f"{where}[{j}]", f"must be a token id in [0, {vocab}), got {t!r}")
    skip = _flag(body, "skip_special_tokens", True)
    texts = await asyncio.get_running_loop().run_in_executor(
        None, lambda: [tm.tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists])
    return {"text": texts[0] if single else texts}


def _check_fields(body: Any, fields: tuple[str, ...]) -> None:
    check_fields(body, fields, "this route")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ValidationError("model", f"must be a string, got {type_name(body['model'])}")


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ValidationError(name, f"must be a boolean, got {type_name(value)}")
    return value

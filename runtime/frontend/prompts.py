"""The prompts of a native `/generate` request: their shapes (one or a batch, text or token ids),
their token ids, and fitting each into the context with its max_new_tokens. Part of
`validation.normalize_generate_request`; errors name the prompt's field."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tandem.runtime.frontend.generate_request import GenerateRequest
from tandem.runtime.frontend.limits import RequestLimits
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.value_checks import ValidationError, is_int, short, type_name

logger = logging.getLogger(__name__)
Prompt = tuple[str, Any]  # (field name for messages, raw text str or raw id list)
SGLANG_TRUNCATE_SLACK = 5  # SGLang's scheduler: max_req_input_len = max_req_len - 5


def prompts(req: GenerateRequest) -> tuple[list[Prompt], bool]:
    text, ids = req.text, req.input_ids
    if text is not None and ids is not None:
        raise ValidationError("input_ids", "cannot be combined with text; give exactly one")
    if text is None and ids is None:
        raise ValidationError("text", "is required (or give input_ids)")
    if text is not None:
        return _text_prompts(text)
    return _ids_prompts(ids)


def _text_prompts(text: Any) -> tuple[list[Prompt], bool]:
    if isinstance(text, str):
        return [("text", text)], False
    if not isinstance(text, list):
        got = type_name(text)
        raise ValidationError("text", f"must be a string or a list of strings, got {got}")
    if not text:
        raise ValidationError("text", "must not be an empty list")
    for i, t in enumerate(text):
        if not isinstance(t, str):
            raise ValidationError(f"text[{i}]", f"must be a string, got {type_name(t)}")
    return [(f"text[{i}]", t) for i, t in enumerate(text)], True


def _ids_prompts(ids: Any) -> tuple[list[Prompt], bool]:
    if not isinstance(ids, list):
        got = type_name(ids)
        raise ValidationError("input_ids", f"must be a list of token ids, got {got}")
    if not ids:
        raise ValidationError("input_ids", "must not be empty")
    if not isinstance(ids[0], list):
        return [("input_ids", ids)], False  # element types are checked with the ids
    for i, row in enumerate(ids):
        if not isinstance(row, list):
            got = type_name(row)
            raise ValidationError(f"input_ids[{i}]", f"must be a list of token ids, got {got}")
    return [(f"input_ids[{i}]", row) for i, row in enumerate(ids)], True


def check_batch_items(prompts: list[Prompt], params: list[tuple[str, SamplingParams]], cap: int) -> None:
    """Every prompt x choice becomes a sequence in the scheduler: bound them before any work."""
    total = sum(sp.n for _, sp in params)
    if total > cap:
        what = f"{len(prompts)} prompt(s) x n = {total} sequences" if total != len(prompts) else f"{total} prompts"
        raise ValidationError(prompts[0][0].split("[")[0], f"asks for {what}, more than --max-batch-items ({cap})")


def prompt_ids(
    field: str, prompt: Any, tokenize: Callable[[str], list[int]], limits: RequestLimits
) -> tuple[list[int], str | None]:
    vocab_size = limits.vocab_size
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationError(field, "must not be empty")
        cap = limits.max_text_chars
        if cap is not None and len(prompt) > cap:
            if not limits.allow_auto_truncate:
                msg = f"has {len(prompt)} characters; no text longer than {cap} fits the context ({limits.context_len} tokens)"
                raise ValidationError(field, msg)
            prompt = prompt[:cap]  # still more tokens than fit: cut to the context below
        ids = list(tokenize(prompt))
        if not ids:
            raise ValidationError(field, "tokenizes to zero tokens")
        return ids, prompt
    if not prompt:
        raise ValidationError(field, "must not be empty")
    refuse_overlong(field, len(prompt), limits)  # before a pass over every id of it
    for j, t in enumerate(prompt):
        if not is_int(t):
            got = type_name(t)
            raise ValidationError(f"{field}[{j}]", f"must be an integer token id, got {got}")
        if not 0 <= t < vocab_size:
            raise ValidationError(f"{field}[{j}]", f"must be in [0, {vocab_size}), got {short(t)}")
    return list(prompt), None


def explicit_max_new(sp: Any, i: int) -> bool:
    """Whether item i's sampling params (`sp`: the request's, one object or one per item) name max_new_tokens."""
    d = sp[i] if isinstance(sp, list) else sp
    return isinstance(d, dict) and d.get("max_new_tokens") is not None


def fit_context(
    field: str, ids: list[int], sp_field: str, sp: SamplingParams, explicit: bool, limits: RequestLimits
) -> list[int]:
    """The prompt's ids, cut under --allow-auto-truncate when they leave no room for an output
    token. prompt + max_new_tokens must fit the context. Like SGLang, only an explicit
    max_new_tokens is an error, and not under --allow-auto-truncate; the default (128) and null
    (fill the context) are clamped to the room that is left, in the context and in the KV pool."""
    if limits.allow_auto_truncate and len(ids) >= limits.max_request_len:
        ids = _truncated(field, ids, sp, explicit, limits)
    _fit_max_new(field, len(ids), sp_field, sp, explicit, limits)
    return ids


def _truncated(field: str, ids: list[int], sp: SamplingParams, explicit: bool, limits: RequestLimits) -> list[int]:
    """--allow-auto-truncate, as SGLang users see it: its scheduler holds a request to max_req_len
    tokens (one less than the context, or the KV pool when smaller), cuts a prompt to its first
    max_req_len - 5 and leaves the output max_req_len - prompt - 1 (4). An explicit max_new_tokens
    was cut before that, by its tokenizer manager, to what the context leaves the prompt: none
    when the prompt passed the context (it cut that prompt to the context first)."""
    max_req_len = limits.max_request_len - 1
    keep = max(max_req_len - SGLANG_TRUNCATE_SLACK, 1)
    logger.warning("%s has %d tokens: truncated to %d (--allow-auto-truncate)", field, len(ids), keep)
    room = max(max_req_len - keep - 1, 0)
    if explicit:
        room = min(room, max(limits.context_len - len(ids), 0))
    sp.max_new_tokens = min(sp.max_new_tokens, room)
    return ids[:keep]


def refuse_overlong(field: str, prompt_len: int, limits: RequestLimits) -> None:
    """A prompt must leave the context room for a token (SGLang's >= bound too), unless
    --allow-auto-truncate cuts it. Its length alone decides, so a front end that holds the ids
    in another form can check it before it lists and reads tens of millions of them."""
    ctx = limits.context_len
    if prompt_len >= ctx and not limits.allow_auto_truncate:
        raise ValidationError(field, f"has {prompt_len} tokens; a prompt must be shorter than the context length ({ctx})")


def _fit_max_new(
    field: str, prompt_len: int, sp_field: str, sp: SamplingParams, explicit: bool, limits: RequestLimits
) -> None:
    ctx = limits.context_len
    refuse_overlong(field, prompt_len, limits)  # a truncated prompt is shorter already
    kv = limits.max_total_tokens
    # a prompt that fills the KV pool is the scheduler's 400, not a clamp to an empty answer
    room = limits.max_request_len if kv and prompt_len < kv else ctx
    if (not explicit or limits.allow_auto_truncate) and prompt_len + sp.max_new_tokens > room:
        sp.max_new_tokens = max(room - prompt_len, 0)
    if sp.min_new_tokens > sp.max_new_tokens:  # parsing checked the client's: a cut made it so
        pool = f", {limits.max_total_tokens} KV slots" if room < ctx else ""
        msg = (
            f"is {sp.min_new_tokens}, but only {sp.max_new_tokens} tokens fit after the "
            f"{prompt_len}-token prompt (context length {ctx}{pool})"
        )
        raise ValidationError(f"{sp_field}.min_new_tokens", msg)
    max_new = sp.max_new_tokens
    if prompt_len + max_new > ctx:
        msg = (
            f"is {max_new}; with the {prompt_len}-token prompt that is {prompt_len + max_new} "
            f"tokens, more than the context length ({ctx})"
        )
        raise ValidationError(f"{sp_field}.max_new_tokens", msg)

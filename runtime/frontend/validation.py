"""Normalize and validate a native `/generate` request (SGLang `GenerateReqInput` semantics).

`normalize_generate_request` turns a single or batched request (a JSON body, or the
GenerateRequest a front end built) into one `GenerateItem` per prompt,
every field checked; any problem is a `ValidationError` whose text names the field (HTTP 400).
`n > 1` is not expanded here: it stays in `sampling_params.n` for the tokenizer manager. The
prompts themselves (shapes, token ids, fitting the context) are `prompts.py`'s.

Top-level keys: the ones below are handled; a small allowlist of other SGLang fields
(`IGNORED_KEYS`: disaggregation, DP routing, logging, tracing) is accepted and dropped, so
SGLang clients and the SGLang Model Gateway work unchanged (a DP rank must name this server's
one rank, 0, as SGLang refuses a rank out of range); inputs and outputs this server does
not have (`MEDIA_KEYS`: media, sessions, LoRA, custom logit processors, ...) are accepted only
when empty, because silently dropping one would change the answer; anything else is a 400
naming the key, which catches typos like `max_tokens`.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import msgspec

from tandem.ipc.messages import LogprobParams
from tandem.runtime.sampling.params import SamplingParams, params_from_request
from tandem.runtime.frontend.generate_request import GenerateRequest
from tandem.runtime.frontend.limits import RequestLimits
from tandem.runtime.frontend.prompts import check_batch_items, explicit_max_new, fit_context, prompt_ids, prompts
from tandem.runtime.value_checks import ValidationError, fits_int64, is_int, key_name, short, type_name

__all__ = [
    "GenerateItem",
    "GenerateRequest",
    "NormalizedBatch",
    "RequestLimits",
    "ValidationError",
    "check_rids_free",
    "normalize_generate_request",
    "read_body",
]

HANDLED_KEYS = frozenset(
    {
        "text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
        "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
        "priority", "extra_key", "return_flat_raw_top_logprobs",
        "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
        "return_hidden_states", "require_reasoning", "max_thinking_tokens", "cache_salt",
        "return_prompt_token_ids", "routed_dp_rank", "data_parallel_rank",
    }
)  # fmt: skip
# Routing, disaggregation, logging and tracing fields: they do not change the answer.
IGNORED_KEYS = frozenset(
    {
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
        "decode_tp_size", "disagg_prefill_dp_rank",
        "log_metrics", "no_logs", "custom_labels", "conversation_id", "routing_key",
        "received_time", "external_trace_header", "modalities", "model", "http_worker_ipc",
        "kv_router_hint", "need_wait_for_mm_inputs", "encoder_urls", "num_items_assigned",
    }
)  # fmt: skip
# Inputs and outputs this server does not have: accepted only when empty (or false), because
# silently dropping an image, an adapter or a requested output would change the answer.
MEDIA_KEYS = frozenset(
    {
        "image_data", "video_data", "audio_data", "input_embeds", "session_params", "lora_path",
        "lora_id", "custom_logit_processor", "return_routed_experts", "return_entropy",
        "return_sampling_mask", "return_bytes", "background", "session_id", "routed_experts_start_len",
        "return_indexer_topk", "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config",
        "images_config", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
        "video_max_dynamic_patch", "positional_embed_overrides", "multi_item_delimiter_indices",
    }
)  # fmt: skip
MEDIA_DEFAULTS = {"routed_experts_start_len": 0}  # SGLang's defaults that are not empty values
FLAT_FLAGS = ("return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs")


class GenerateItem(msgspec.Struct, kw_only=True):
    """One validated prompt of a /generate call."""

    rid: str
    input_ids: list[int]
    text: str | None
    sampling_params: SamplingParams
    stream: bool = False
    logprob: LogprobParams = LogprobParams()
    return_hidden_states: bool = False
    return_text_in_logprobs: bool = False
    require_reasoning: bool = False
    priority: int | None = None
    extra_key: str | None = None
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_output_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    return_prompt_token_ids: bool = False


class NormalizedBatch(msgspec.Struct, kw_only=True):
    """`is_batch` tells the response formatter to answer with a list."""

    is_batch: bool
    items: list[GenerateItem]


def check_rids_free(items: list[GenerateItem], running: Collection[str]) -> None:
    """A rid may not be reused while a request with it is still running (the tokenizer manager
    checks every item of a batch before it sends any)."""
    for i, item in enumerate(items):
        if item.rid in running:
            field = "rid" if len(items) == 1 else f"rid[{i}]"
            raise ValidationError(field, f"{short(item.rid)} is already used by a running request")


def read_body(body: Any) -> GenerateRequest:
    """A native JSON body as a GenerateRequest: an object, every key known (see the module doc)."""
    if not isinstance(body, dict):
        raise ValidationError("body", f"must be a JSON object, got {type_name(body)}")
    _check_keys(body)
    return GenerateRequest.from_body(body)


def normalize_generate_request(
    body: Any, limits: RequestLimits, tokenize: Callable[[str], list[int]]
) -> NormalizedBatch:
    """`body`: a native JSON body, or a GenerateRequest a front end built (checked alike)."""
    req = body if isinstance(body, GenerateRequest) else read_body(body)
    _check_dp_ranks(req)
    prompts_, is_batch = prompts(req)
    n = len(prompts_)
    vocab_size = limits.vocab_size
    shared = _shared_flags(req)
    rids = _rids(req.rid, n, is_batch)
    params = _sampling_params(req.sampling_params, n, is_batch, vocab_size, limits.guided_decoding)
    check_batch_items(prompts_, params, limits.max_batch_items)
    reasoning = _per_item(req, "require_reasoning", n, is_batch, False, _bool)
    budget_field = _thinking_budget(req.max_thinking_tokens, params)
    for (f, sp), (reasoning_field, require_reasoning) in zip(params, reasoning):
        if require_reasoning and not limits.reasoning_parser:  # the grammar would wait for an end never defined
            msg = "needs --reasoning-parser on the server (it defines where the reasoning ends)"
            raise ValidationError(reasoning_field, msg)
        _check_thinking_budget(budget_field or f"{f}.max_thinking_tokens", sp, require_reasoning,
                               limits.strict_thinking)
    return_logprob = _per_item(req, "return_logprob", n, is_batch, False, _bool)
    start_lens = _per_item(req, "logprob_start_len", n, is_batch, -1, _start_len)
    columns = min(vocab_size, limits.max_top_logprobs_num)  # logprobs per position, each a row of the output
    top_nums = _per_item(req, "top_logprobs_num", n, is_batch, 0, _top_num(columns))
    token_lists = _token_ids_logprob(req.token_ids_logprob, n, is_batch, vocab_size, columns)
    extra_keys = _per_item(req, "extra_key", n, is_batch, None, _extra_key)
    salts = _per_item(req, "cache_salt", n, is_batch, None, _extra_key)
    hidden = _per_item(req, "return_hidden_states", n, is_batch, False, _bool)
    items = []
    for i, (field, prompt) in enumerate(prompts_):
        ids, text = prompt_ids(field, prompt, tokenize, limits)
        sp_field, sp = params[i]
        ids = fit_context(field, ids, sp_field, sp, explicit_max_new(req.sampling_params, i), limits)
        start_field, start = start_lens[i]
        # SGLang refuses a logprob start at the prompt's end (no prompt token left to score);
        # hidden states alone may start there (no prompt rows)
        scored = return_logprob[i][1]
        if (scored or hidden[i][1]) and start > len(ids) - scored:
            bound = "<" if scored else "<="
            raise ValidationError(start_field, f"must be {bound} the prompt length ({len(ids)} tokens), got {start}")
        token_ids = token_lists[i]
        items.append(
            GenerateItem(
                rid=rids[i],
                input_ids=ids,
                text=text,
                sampling_params=sp,
                logprob=LogprobParams(
                    return_logprob=return_logprob[i][1],
                    logprob_start_len=start,
                    top_logprobs_num=top_nums[i][1],
                    token_ids_logprob=None if token_ids is None else tuple(token_ids),
                ),
                return_hidden_states=hidden[i][1],
                require_reasoning=reasoning[i][1],
                extra_key=_cache_namespace(extra_keys[i][1], salts[i][1]),
                **shared,
            )
        )
    return NormalizedBatch(is_batch=is_batch, items=items)


def _thinking_budget(budget: Any, params: list[tuple[str, SamplingParams]]) -> str | None:
    """SGLang's top-level max_thinking_tokens, for every item; also accepted inside
    sampling_params. Returns the field to name in errors when it was given at the top."""
    if budget is None:
        return None
    budget = _int("max_thinking_tokens", budget)
    if budget < 0:
        raise ValidationError("max_thinking_tokens", f"must be >= 0, got {budget}")
    for f, sp in params:
        if sp.max_thinking_tokens is not None:
            raise ValidationError("max_thinking_tokens", f"is also given as {f}.max_thinking_tokens; give one")
    for _, sp in params:
        sp.max_thinking_tokens = budget
    return "max_thinking_tokens"


def _check_thinking_budget(field: str, sp: SamplingParams, require_reasoning: bool, strict: bool) -> None:
    if sp.max_thinking_tokens is None:
        return
    if not strict:
        raise ValidationError(field, "needs --enable-strict-thinking on the server")
    if sp.constraint is not None and not require_reasoning:  # the grammar would hold from the first token
        raise ValidationError(field, "with a constraint needs require_reasoning=true")


def _cache_namespace(extra_key: str | None, cache_salt: str | None) -> str | None:
    """SGLang's extra_key and cache_salt both separate prefix-cache namespaces: requests share
    cached prefixes only when both agree."""
    if cache_salt is None:
        return extra_key
    return f"{extra_key or ''}\x00{cache_salt}"


def _check_keys(body: dict) -> None:
    for key, value in body.items():
        if key in HANDLED_KEYS or key in IGNORED_KEYS:
            continue
        if key in MEDIA_KEYS:
            if _is_empty(value) or (key in MEDIA_DEFAULTS and value == MEDIA_DEFAULTS[key] and type(value) is int):
                continue
            raise ValidationError(key, "is not supported by this server")
        raise ValidationError(key_name(key), "is not a known /generate field")


def _check_dp_ranks(req: GenerateRequest) -> None:
    """SGLang's routed_dp_rank (and its deprecated name data_parallel_rank) picks a DP rank; this
    server is one rank, 0: another rank is out of range, a 400 as in SGLang and on gRPC, never a
    request silently served by a rank it did not ask for."""
    for name in ("routed_dp_rank", "data_parallel_rank"):
        if (rank := getattr(req, name)) is not None:
            check_dp_rank(name, rank)


def check_dp_rank(name: str, rank: Any) -> None:
    """One DP rank asked for (a body field, or the X-Data-Parallel-Rank header): this server's is 0."""
    if _int(name, rank) != 0:
        raise ValidationError(name, f"this server has one rank (0), got {rank}")


def _is_empty(v: Any) -> bool:
    """None, False, "", {} or (nested) lists of those; iterative so deep nesting cannot recurse."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif not (x is None or x is False or x == {} or x == ""):
            return False
    return True


# ---- per-request fields ------------------------------------------------------------------


def _rids(rid: Any, n: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        if not rid:
            raise ValidationError("rid", "must not be empty")
        # SGLang: a string rid for a batch is a prefix, item i gets "<rid>_<i>".
        return [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    if not is_batch or not isinstance(rid, list):
        want = "a string or a list of strings" if is_batch else "a string"
        raise ValidationError("rid", f"must be {want}, got {type_name(rid)}")
    _check_len("rid", rid, n)
    for i, r in enumerate(rid):
        if not isinstance(r, str) or not r:
            raise ValidationError(f"rid[{i}]", f"must be a non-empty string, got {short(r)}")
    dups = [r for r, c in Counter(rid).items() if c > 1]
    if dups:
        raise ValidationError("rid", f"has duplicate request ids in the batch: {short(dups)}")
    return list(rid)


def _check_len(field: str, values: list, n: int) -> None:
    if len(values) != n:
        raise ValidationError(field, f"has {len(values)} entries but the batch has {n} prompts")


def _sampling_params(
    sp: Any, n: int, is_batch: bool, vocab_size: int, guided: bool
) -> list[tuple[str, SamplingParams]]:
    if is_batch and isinstance(sp, list):
        _check_len("sampling_params", sp, n)
        fields = [f"sampling_params[{i}]" for i in range(n)]
        return [
            (f, params_from_request(d, vocab_size, field=f, guided_decoding=guided))
            for f, d in zip(fields, sp)
        ]
    shared = params_from_request(sp, vocab_size, guided_decoding=guided)
    # Shallow copies: a per-item scalar edit (e.g. clamping max_new_tokens) must not leak into
    # siblings; the lists inside are never mutated after validation.
    return [("sampling_params", msgspec.structs.replace(shared)) for _ in range(n)]


Checker = Callable[[str, Any], Any]


def _per_item(
    req: GenerateRequest, name: str, n: int, is_batch: bool, default: Any, check: Checker
) -> list[tuple[str, Any]]:
    """SGLang per-item fields: a scalar shared by the batch, or (batch only) one per prompt."""
    v = getattr(req, name)
    if v is None:
        return [(name, default)] * n
    if is_batch and isinstance(v, list):
        _check_len(name, v, n)
        return [(f"{name}[{i}]", check(f"{name}[{i}]", x)) for i, x in enumerate(v)]
    return [(name, check(name, v))] * n


def _bool(field: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValidationError(field, f"must be a boolean, got {type_name(v)}")
    return v


def _int(field: str, v: Any) -> int:
    if not is_int(v):
        raise ValidationError(field, f"must be an integer, got {type_name(v)}")
    if not fits_int64(v):
        raise ValidationError(field, f"must fit in a 64-bit integer, got {short(v)}")
    return v


def _start_len(field: str, v: Any) -> int:
    if _int(field, v) < -1:
        raise ValidationError(field, f"must be >= -1 (-1 = output tokens only), got {v}")
    return v


def _top_num(cap: int) -> Checker:
    def check(field: str, v: Any) -> int:
        if not 0 <= _int(field, v) <= cap:
            raise ValidationError(field, f"must be in [0, {cap}] (--max-top-logprobs-num), got {v}")
        return v

    return check


def _extra_key(field: str, v: Any) -> str | None:
    if not isinstance(v, str):
        raise ValidationError(field, f"must be a string, got {type_name(v)}")
    return v or None  # SGLang: an empty extra_key means no namespace


def _token_ids_logprob(
    v: Any, n: int, is_batch: bool, vocab_size: int, cap: int
) -> list[list[int] | None]:
    if v is None or v == []:
        return [None] * n
    if not isinstance(v, list):
        got = type_name(v)
        raise ValidationError("token_ids_logprob", f"must be a list of token ids, got {got}")
    if is_batch and any(row is None or isinstance(row, list) for row in v):  # one list (or null) per item
        _check_len("token_ids_logprob", v, n)
        return [_id_list(f"token_ids_logprob[{i}]", row, vocab_size, cap) for i, row in enumerate(v)]
    return [_id_list("token_ids_logprob", v, vocab_size, cap)] * n


def _id_list(field: str, v: Any, vocab_size: int, cap: int) -> list[int] | None:
    if v is None or v == []:
        return None
    if not isinstance(v, list):
        raise ValidationError(field, f"must be a list of token ids, got {type_name(v)}")
    if len(v) > cap:  # each id is a logprob at every position: the same budget as top_logprobs_num
        raise ValidationError(field, f"at most {cap} token ids (--max-top-logprobs-num), got {len(v)}")
    for j, t in enumerate(v):
        if not is_int(t) or not 0 <= t < vocab_size:
            msg = f"must be a token id in [0, {vocab_size}), got {short(t)}"
            raise ValidationError(f"{field}[{j}]", msg)
    return list(v)


# ---- batch-wide fields -------------------------------------------------------------------


def _shared_flags(req: GenerateRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = ("stream", "return_text_in_logprobs", *FLAT_FLAGS, "return_flat_raw_top_logprobs_b64",
             "return_prompt_token_ids")
    for name in names:
        v = getattr(req, name)
        out[name] = False if v is None else _bool(name, v)
    if out["return_flat_raw_top_logprobs_b64"] and not any(out[f] for f in FLAT_FLAGS):
        msg = f"requires {FLAT_FLAGS[0]} or {FLAT_FLAGS[1]}"
        raise ValidationError("return_flat_raw_top_logprobs_b64", msg)
    if out["return_flat_raw_output_top_logprobs"] and out["stream"]:
        msg = "cannot be used with stream=true (output arrays are built once, at the end)"
        raise ValidationError("return_flat_raw_output_top_logprobs", msg)
    priority = req.priority
    out["priority"] = None if priority is None else _int("priority", priority)
    return out

"""normalize_generate_request: shapes, defaults, every rule, and a fuzz test."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.ipc.messages import LogprobParams
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.frontend.validation import (
    HANDLED_KEYS,
    IGNORED_KEYS,
    MEDIA_KEYS,
    NormalizedBatch,
    ValidationError,
    check_rids_free,
    RequestLimits,
    normalize_generate_request,
)

VOCAB = 100
CTX = 64


def tokenize(s: str) -> list[int]:
    """One token per non-space character, so prompt lengths are easy to reason about."""
    return [ord(c) % VOCAB for c in s if not c.isspace()]


LIMITS = RequestLimits(vocab_size=VOCAB, context_len=CTX, max_batch_items=16, max_top_logprobs_num=VOCAB,
                       max_text_chars=4 * CTX)


def norm(body: Any, **limits: Any) -> NormalizedBatch:
    return normalize_generate_request(body, dataclasses.replace(LIMITS, **limits), tokenize)


def test_single_text_defaults() -> None:
    out = norm({"text": "abc"})
    assert not out.is_batch and len(out.items) == 1
    it = out.items[0]
    assert it.input_ids == tokenize("abc") and it.text == "abc"
    assert len(it.rid) == 32 and int(it.rid, 16) >= 0  # uuid4 hex
    # The default max_new_tokens (128) is clamped to the room left in the 64-token context.
    assert it.sampling_params == SamplingParams(max_new_tokens=CTX - 3)
    assert not it.stream and not it.return_hidden_states and it.logprob == LogprobParams()
    assert (it.logprob.return_logprob, it.logprob.logprob_start_len, it.logprob.top_logprobs_num) == (False, -1, 0)
    assert it.logprob.token_ids_logprob is None and it.priority is None and it.extra_key is None


def test_single_input_ids_and_options() -> None:
    body = {
        "input_ids": [1, 2, 3], "rid": "r1", "stream": True, "return_logprob": True,
        "logprob_start_len": 2, "top_logprobs_num": 5, "token_ids_logprob": [7, 8],
        "return_text_in_logprobs": True, "priority": -5, "extra_key": "tenant", "return_hidden_states": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "seed": 3},
    }  # fmt: skip
    it = norm(body).items[0]
    assert (it.rid, it.input_ids, it.text, it.stream) == ("r1", [1, 2, 3], None, True)
    assert it.logprob == LogprobParams(return_logprob=True, logprob_start_len=2, top_logprobs_num=5,
                                       token_ids_logprob=(7, 8))
    assert it.return_text_in_logprobs and it.return_hidden_states
    assert (it.priority, it.extra_key) == (-5, "tenant")
    assert it.sampling_params.is_greedy and it.sampling_params.sampling_seed == 3


def test_require_reasoning_and_the_thinking_budget() -> None:
    assert norm({"text": "ab"}).items[0].require_reasoning is False
    out = norm({"text": ["ab", "cd"], "require_reasoning": [True, False]}, reasoning_parser=True)
    assert [i.require_reasoning for i in out.items] == [True, False]
    with pytest.raises(ValidationError, match="require_reasoning must be a boolean"):
        norm({"text": "ab", "require_reasoning": 1}, reasoning_parser=True)
    budget = {"max_thinking_tokens": 4, "regex": "a+"}
    with pytest.raises(ValidationError, match="max_thinking_tokens needs --enable-strict-thinking"):
        norm({"text": "ab", "require_reasoning": True, "sampling_params": budget}, reasoning_parser=True)
    with pytest.raises(ValidationError, match="max_thinking_tokens with a constraint needs require_reasoning"):
        norm({"text": "ab", "sampling_params": budget}, strict_thinking=True)
    ok = norm({"text": "ab", "require_reasoning": True, "sampling_params": budget}, strict_thinking=True,
              reasoning_parser=True).items[0]
    assert ok.require_reasoning and ok.sampling_params.max_thinking_tokens == 4


def test_require_reasoning_needs_a_reasoning_parser() -> None:
    """Without --reasoning-parser the server knows no end of the reasoning: the grammar would
    wait for a `</think>` a plain model never writes (a 200 with an unconstrained answer)."""
    with pytest.raises(ValidationError, match="^require_reasoning needs --reasoning-parser"):
        norm({"text": "ab", "require_reasoning": True, "sampling_params": {"regex": "a+"}})
    with pytest.raises(ValidationError, match=r"^require_reasoning\[1\] needs --reasoning-parser"):
        norm({"text": ["ab", "cd"], "require_reasoning": [False, True]})
    assert norm({"text": "ab", "require_reasoning": False}).items[0].require_reasoning is False


def test_top_level_thinking_budget_as_sglangs_generate_req_input() -> None:
    """SGLang's GenerateReqInput has max_thinking_tokens at the top, for the whole call; errors
    name it there, and giving it in both places is a 400."""
    out = norm({"text": ["ab", "cd"], "max_thinking_tokens": 3}, strict_thinking=True)
    assert [i.sampling_params.max_thinking_tokens for i in out.items] == [3, 3]
    with pytest.raises(ValidationError, match="^max_thinking_tokens needs --enable-strict-thinking"):
        norm({"text": "ab", "max_thinking_tokens": 3})
    with pytest.raises(ValidationError, match="^max_thinking_tokens must be >= 0"):
        norm({"text": "ab", "max_thinking_tokens": -1}, strict_thinking=True)
    with pytest.raises(ValidationError, match="also given as sampling_params.max_thinking_tokens"):
        norm({"text": "ab", "max_thinking_tokens": 3, "sampling_params": {"max_thinking_tokens": 2}},
             strict_thinking=True)


def test_cache_salt_separates_prefix_cache_namespaces_with_extra_key() -> None:
    items = norm({"text": ["a", "b", "c"], "cache_salt": ["", "s", "s"], "extra_key": ["", "", "k"]}).items
    assert items[0].extra_key is None and len({i.extra_key for i in items}) == 3
    assert norm({"text": "a", "cache_salt": "s"}).items[0].extra_key != norm({"text": "a", "extra_key": "s"}).items[0].extra_key


def test_return_prompt_token_ids_and_dropped_custom_params() -> None:
    item = norm({"input_ids": [4, 5], "return_prompt_token_ids": True,
                 "sampling_params": {"custom_params": {"k": 1}}}).items[0]
    assert item.return_prompt_token_ids and not norm({"text": "a"}).items[0].return_prompt_token_ids


def test_batch_text_shared_params_and_rid_prefix() -> None:
    out = norm({"text": ["ab", "cd", "ef"], "rid": "job", "sampling_params": {"top_k": 5}})
    assert out.is_batch and [i.rid for i in out.items] == ["job_0", "job_1", "job_2"]
    assert all(i.sampling_params.top_k == 5 for i in out.items)
    assert out.items[0].sampling_params is not out.items[1].sampling_params


def test_batch_ids_per_item_fields() -> None:
    body = {
        "input_ids": [[1, 2], [3]], "rid": ["a", "b"],
        "sampling_params": [{"temperature": 0}, {"temperature": 0.7}],
        "return_logprob": [True, False], "logprob_start_len": [0, -1],
        "top_logprobs_num": [2, 0], "token_ids_logprob": [[1], None], "extra_key": ["x", ""],
    }  # fmt: skip
    a, b = norm(body).items
    assert (a.rid, a.input_ids, b.rid, b.input_ids) == ("a", [1, 2], "b", [3])
    assert a.sampling_params.temperature == 0 and b.sampling_params.temperature == 0.7
    assert (a.logprob.return_logprob, b.logprob.return_logprob, a.logprob.top_logprobs_num) == (True, False, 2)
    assert (a.logprob.token_ids_logprob, b.logprob.token_ids_logprob) == ((1,), None)
    assert (a.extra_key, b.extra_key) == ("x", None)


def test_batch_without_rid_gets_unique_uuids() -> None:
    items = norm({"text": ["a", "b"]}).items
    assert items[0].rid != items[1].rid


def test_n_stays_in_sampling_params() -> None:
    out = norm({"text": "abc", "sampling_params": {"n": 4}})
    assert not out.is_batch and len(out.items) == 1 and out.items[0].sampling_params.n == 4


def test_ignored_and_empty_media_keys_are_accepted() -> None:
    body = {
        "text": "a", "lora_path": None, "log_metrics": False, "image_data": None, "return_entropy": False,
        "data_parallel_rank": 0, "bootstrap_host": "h", "custom_logit_processor": None,
    }  # fmt: skip
    assert norm(body).items[0].input_ids == [ord("a") % VOCAB]
    assert norm({"text": ["a", "b"], "image_data": [None, None]}).is_batch
    # a whole GenerateReqInput serialized by an SGLang client: its unused fields at their defaults
    defaults = {"session_id": None, "routed_experts_start_len": 0, "mm_hashes": None, "http_worker_ipc": "x",
                "kv_router_hint": None, "positional_embed_overrides": None, "need_wait_for_mm_inputs": False,
                # its multimodal tiling controls: without images they change nothing
                "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
                "video_max_dynamic_patch": None}
    assert norm({"text": "a", **defaults}).items[0].input_ids == [ord("a") % VOCAB]
    with pytest.raises(ValidationError, match="routed_experts_start_len is not supported"):
        norm({"text": "a", "routed_experts_start_len": 2})
    with pytest.raises(ValidationError, match="min_dynamic_patch is not supported"):
        norm({"text": "a", "min_dynamic_patch": 4})
    with pytest.raises(ValidationError, match="multi_item_delimiter_indices is not supported"):
        norm({"text": "a", "multi_item_delimiter_indices": [0]})  # a 0 there is a value, not a default


def test_a_dp_rank_other_than_this_servers_one_is_refused() -> None:
    # SGLang refuses a routed_dp_rank out of [0, dp_size); it was accepted here and the request
    # served as if it had asked for no rank
    for name in ("routed_dp_rank", "data_parallel_rank"):
        assert norm({"text": "a", name: 0}).items[0].input_ids == [ord("a") % VOCAB]
        assert norm({"text": "a", name: None}).items[0].input_ids == [ord("a") % VOCAB]
        with pytest.raises(ValidationError, match=rf"^{name} this server has one rank \(0\), got 3$"):
            norm({"text": "a", name: 3})
        with pytest.raises(ValidationError, match=rf"^{name} must be an integer, got str$"):
            norm({"text": "a", name: "0"})


def test_what_the_gateway_adds_to_generate_is_accepted() -> None:
    # smg 1.13.0 re-serializes /generate bodies with these fields (observed with a logging worker)
    body = {"model": "unknown", "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4},
            "return_text_in_logprobs": False, "stream": True, "log_metrics": True, "background": False,
            "no_logs": False, "return_bytes": False, "return_entropy": False}
    assert norm(body).items[0].input_ids == [1, 2, 3]


def test_key_sets_are_disjoint() -> None:
    assert not (HANDLED_KEYS & IGNORED_KEYS) and not (MEDIA_KEYS & (HANDLED_KEYS | IGNORED_KEYS))


def test_default_max_new_tokens_is_clamped_but_explicit_is_not() -> None:
    big = 200
    body = {"text": "abcd"}
    out = norm(body, context_len=big)
    assert out.items[0].sampling_params.max_new_tokens == 128
    assert norm(body).items[0].sampling_params.max_new_tokens == CTX - 4
    with pytest.raises(ValidationError, match=r"^sampling_params.max_new_tokens is 128"):
        norm({"text": "abcd", "sampling_params": {"max_new_tokens": 128}})
    with pytest.raises(ValidationError, match=r"^sampling_params.min_new_tokens is 61, but only"):
        norm({"text": "abcd", "sampling_params": {"min_new_tokens": 61}})


def test_null_max_new_tokens_takes_the_room_left_in_the_context_and_the_kv_pool() -> None:
    body = {"text": "abcd", "sampling_params": {"max_new_tokens": None}}
    assert norm(body).items[0].sampling_params.max_new_tokens == CTX - 4
    assert norm(body, max_total_tokens=40).items[0].sampling_params.max_new_tokens == 40 - 4
    assert norm({"text": "abcd"}, max_total_tokens=40).items[0].sampling_params.max_new_tokens == 40 - 4
    # a prompt that fills the pool is not clamped to an empty answer: the scheduler refuses it
    assert norm({"text": "a" * 40}, max_total_tokens=40).items[0].sampling_params.max_new_tokens == CTX - 40
    with pytest.raises(ValidationError, match=r"^sampling_params.min_new_tokens is 37, but only 36 tokens fit after "
                                              r"the 4-token prompt \(context length 64, 40 KV slots\)"):
        norm({"text": "abcd", "sampling_params": {"max_new_tokens": None, "min_new_tokens": 37}}, max_total_tokens=40)


def test_allow_auto_truncate_keeps_the_prompts_head_and_cuts_max_new_tokens() -> None:
    """--allow-auto-truncate, as SGLang users see it: instead of a 400, a prompt that leaves no room
    for an output token keeps its first max_req_len - 5 tokens (SGLang's scheduler's cut, its
    max_req_len one less than the context or the KV pool) and its output max_req_len - prompt - 1 = 4
    tokens at most; an explicit max_new_tokens was cut first to what the context leaves the prompt
    (SGLang's tokenizer manager), none for a prompt past the context. A prompt that fits keeps all
    its tokens, and an explicit max_new_tokens past the room is cut to it."""
    long_ids = list(range(70))
    it = norm({"input_ids": long_ids, "sampling_params": {"max_new_tokens": 10}}, allow_auto_truncate=True).items[0]
    assert it.input_ids == long_ids[:CTX - 6] and it.sampling_params.max_new_tokens == 0
    for sp in ({}, {"max_new_tokens": None}):
        it = norm({"input_ids": long_ids, "sampling_params": sp}, allow_auto_truncate=True).items[0]
        assert it.input_ids == long_ids[:CTX - 6] and it.sampling_params.max_new_tokens == 4
    # the KV pool's bound: a prompt within the context keeps room for an explicit max_new_tokens
    it = norm({"input_ids": long_ids[:50], "sampling_params": {"max_new_tokens": 10}}, allow_auto_truncate=True,
              max_total_tokens=40).items[0]
    assert it.input_ids == long_ids[:34] and it.sampling_params.max_new_tokens == 4
    it = norm({"input_ids": long_ids[:62], "sampling_params": {"max_new_tokens": 10}}, allow_auto_truncate=True,
              max_total_tokens=40).items[0]
    assert it.input_ids == long_ids[:34] and it.sampling_params.max_new_tokens == 2  # SGLang's cut to the context
    it = norm({"text": "a" * 60, "sampling_params": {"max_new_tokens": 50}}, allow_auto_truncate=True).items[0]
    assert len(it.input_ids) == 60 and it.sampling_params.max_new_tokens == CTX - 60
    text = "b" * (4 * CTX + 10)  # past max_text_chars: cut before tokenizing, then to the context
    assert norm({"text": text}, allow_auto_truncate=True).items[0].input_ids == tokenize(text)[:CTX - 6]
    with pytest.raises(ValidationError, match="^input_ids has 70 tokens"):
        norm({"input_ids": long_ids})
    with pytest.raises(ValidationError, match=r"^sampling_params.min_new_tokens is 5, but only 4 tokens fit"):
        norm({"input_ids": long_ids[:60], "sampling_params": {"max_new_tokens": 9, "min_new_tokens": 5}},
             allow_auto_truncate=True)
    with pytest.raises(ValidationError, match=r"^sampling_params.min_new_tokens is 1, but only 0 tokens fit after "
                                              r"the 58-token prompt"):
        norm({"input_ids": long_ids, "sampling_params": {"max_new_tokens": 9, "min_new_tokens": 1}},
             allow_auto_truncate=True)


def test_context_boundary() -> None:
    """prompt + max_new_tokens may fill the context; the prompt alone must leave it a token
    (SGLang's `input_token_num >= context_len` check; the full prompt is a 400 in the cases above)."""
    fills = norm({"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 4}}).items[0]
    assert fills.sampling_params.max_new_tokens == 4
    full = norm({"input_ids": [1] * (CTX - 1), "sampling_params": {"max_new_tokens": 0}}).items[0]
    assert len(full.input_ids) == CTX - 1 and full.sampling_params.max_new_tokens == 0


@pytest.mark.parametrize("key, value", [("lora_path", "adapter"), ("custom_logit_processor", "x"),
                                        ("return_entropy", True), ("image_data", "img.png"),
                                        ("return_bytes", True), ("background", True)])
def test_inputs_and_outputs_the_server_lacks_are_refused(key: str, value: object) -> None:
    # accepting them would answer 200 with something else than what was asked for
    with pytest.raises(ValidationError, match=f"^{key} is not supported"):
        norm({"text": "a", key: value})


def test_check_rids_free_checks_every_item() -> None:
    items = norm({"text": ["a", "b"], "rid": ["x", "y"]}).items
    check_rids_free(items, {"z"})
    with pytest.raises(ValidationError, match=r"^rid\[1\] 'y' is already used"):
        check_rids_free(items, {"y"})
    with pytest.raises(ValidationError, match=r"^rid 'x' is already used"):
        check_rids_free(items[:1], {"x"})


BAD = [
    # (body, field named, message fragment)
    ([{"text": "a"}], "body", "must be a JSON object, got list"),
    ("text", "body", "got str"),
    ({}, "text", "is required"),
    ({"text": "a", "input_ids": [1]}, "input_ids", "cannot be combined with text"),
    ({"text": ""}, "text", "must not be empty"),
    ({"text": "   "}, "text", "tokenizes to zero tokens"),
    ({"text": 5}, "text", "string or a list of strings, got int"),
    ({"text": []}, "text", "must not be an empty list"),
    ({"text": ["a", ""]}, "text[1]", "must not be empty"),
    ({"text": ["a", 3]}, "text[1]", "must be a string, got int"),
    ({"input_ids": []}, "input_ids", "must not be empty"),
    ({"input_ids": "1 2"}, "input_ids", "list of token ids, got str"),
    ({"input_ids": [[1], []]}, "input_ids[1]", "must not be empty"),
    ({"input_ids": [[1], 2]}, "input_ids[1]", "list of token ids, got int"),
    ({"input_ids": [1, True]}, "input_ids[1]", "integer token id, got bool"),
    ({"input_ids": [1, 2.0]}, "input_ids[1]", "integer token id, got float"),
    ({"input_ids": [1, VOCAB]}, "input_ids[1]", "[0, 100), got 100"),
    ({"input_ids": [[1], [-1]]}, "input_ids[1][0]", "[0, 100), got -1"),
    ({"input_ids": [1] * 65, "sampling_params": {"max_new_tokens": 0}}, "input_ids",
     "has 65 tokens; a prompt must be shorter than the context length (64)"),
    ({"input_ids": [1] * 64, "sampling_params": {"max_new_tokens": 0}}, "input_ids",  # SGLang's >= too
     "has 64 tokens; a prompt must be shorter than the context length (64)"),
    ({"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 5}},
     "sampling_params.max_new_tokens", "60-token prompt that is 65 tokens, more than the "
     "context length (64)"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"max_new_tokens": 64}]},
     "sampling_params[1].max_new_tokens", "65 tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature",
     "must be >= 0, got -1"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params[1].top_p",
     "(0, 1]"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "1 entries but the "
     "batch has 2 prompts"),
    ({"text": "a", "sampling_params": [{}]}, "sampling_params", "must be an object, got list"),
    ({"text": "a", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 4}},
     "sampling_params.min_new_tokens", "<= max_new_tokens (4), got 5"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus", "not a known"),
    ({"text": "a", "rid": ""}, "rid", "must not be empty"),
    ({"text": "a", "rid": 5}, "rid", "must be a string, got int"),
    ({"text": "a", "rid": ["x"]}, "rid", "must be a string, got list"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid", "1 entries but the batch has 2"),
    ({"text": ["a", "b"], "rid": ["x", 1]}, "rid[1]", "non-empty string"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid", "duplicate request ids in the batch: ['x']"),
    ({"text": "a", "stream": "yes"}, "stream", "must be a boolean, got str"),
    ({"text": "a", "stream": 1}, "stream", "must be a boolean, got int"),
    ({"text": "a", "return_logprob": 1}, "return_logprob", "boolean"),
    ({"text": "a", "return_logprob": [True]}, "return_logprob", "boolean, got list"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob", "1 entries"),
    ({"text": ["a", "b"], "return_logprob": [True, 0]}, "return_logprob[1]", "boolean"),
    ({"text": "a", "return_text_in_logprobs": 0}, "return_text_in_logprobs", "boolean"),
    ({"text": "abc", "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len",
     "< the prompt length (3 tokens), got 3"),
    ({"text": ["abc", "a"], "return_logprob": True, "logprob_start_len": [0, 1]},
     "logprob_start_len[1]", "prompt length (1 tokens), got 1"),
    ({"text": "abc", "return_hidden_states": True, "logprob_start_len": 4}, "logprob_start_len",
     "<= the prompt length (3 tokens), got 4"),
    ({"text": "a", "logprob_start_len": -2}, "logprob_start_len", ">= -1"),
    ({"text": "a", "logprob_start_len": 1.0}, "logprob_start_len", "integer, got float"),
    ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num", "[0, 100] (--max-top-logprobs-num), got -1"),
    ({"text": "a", "top_logprobs_num": 101}, "top_logprobs_num", "[0, 100]"),
    ({"text": "a", "top_logprobs_num": True}, "top_logprobs_num", "integer, got bool"),
    ({"text": "a", "token_ids_logprob": 5}, "token_ids_logprob", "list of token ids"),
    ({"text": "a", "token_ids_logprob": [1, 100]}, "token_ids_logprob[1]", "[0, 100)"),
    ({"text": ["a", "b"], "token_ids_logprob": [[1], [2], [3]]}, "token_ids_logprob",
     "3 entries"),
    ({"text": ["a", "b"], "token_ids_logprob": [[1], [-2]]}, "token_ids_logprob[1][0]",
     "[0, 100)"),
    ({"text": "a", "priority": 2**63}, "priority", "64-bit"),
    ({"text": "a", "priority": -(2**63) - 1}, "priority", "64-bit"),
    ({"text": "a", "priority": 1.5}, "priority", "integer, got float"),
    ({"text": "a", "priority": False}, "priority", "integer, got bool"),
    ({"text": "a", "extra_key": 3}, "extra_key", "must be a string"),
    ({"text": ["a", "b"], "extra_key": ["x"]}, "extra_key", "1 entries"),
    ({"text": "a", "return_flat_raw_top_logprobs_b64": True}, "return_flat_raw_top_logprobs_b64",
     "requires return_flat_raw_top_logprobs or return_flat_raw_output_top_logprobs"),
    ({"text": "a", "stream": True, "return_flat_raw_output_top_logprobs": True},
     "return_flat_raw_output_top_logprobs", "stream=true"),
    ({"text": "a", "return_flat_raw_top_logprobs": "y"}, "return_flat_raw_top_logprobs",
     "boolean"),
    ({"text": "a", "max_tokens": 5}, "max_tokens", "is not a known /generate field"),
    ({"text": "a", "image_data": "cat.png"}, "image_data", "not supported"),
    ({"text": "a", "input_embeds": [[0.1]]}, "input_embeds", "not supported"),
    ({"text": "a", "sampling_params": {"temperature": math.nan}}, "sampling_params.temperature",
     "finite"),
]  # fmt: skip


@pytest.mark.parametrize(
    "body, field, fragment", BAD, ids=[f"{i}:{b[1]}" for i, b in enumerate(BAD)]
)
def test_rejects(body: Any, field: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        norm(body)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(field + " ")
    assert fragment in info.value.message, str(info.value)


def test_flat_b64_with_a_flat_flag_is_fine() -> None:
    for flag in ("return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs"):
        it = norm({"text": "a", flag: True, "return_flat_raw_top_logprobs_b64": True}).items[0]
        assert getattr(it, flag) and it.return_flat_raw_top_logprobs_b64
    norm({"text": "a", "stream": True, "return_flat_raw_top_logprobs": True})


# ---- fuzz --------------------------------------------------------------------------------

json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6) | st.sampled_from(["", "0", "123", "-1", "abc", "12x"])
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
SP_KEYS = [*SamplingParams.__struct_fields__, "seed", "bogus"]
small_ints = st.integers(min_value=-3, max_value=VOCAB + 3)
sampling_dicts = st.dictionaries(
    st.sampled_from(SP_KEYS), json_values | small_ints | st.floats(-3, 3), max_size=6
)
TOP_KEYS = sorted(HANDLED_KEYS | IGNORED_KEYS | MEDIA_KEYS) + ["bogus"]
top_values = (
    json_values
    | sampling_dicts
    | st.lists(sampling_dicts, max_size=3)
    | st.lists(small_ints, max_size=8)
    | st.lists(st.lists(small_ints, max_size=5), max_size=3)
    | st.lists(st.text(max_size=5), max_size=3)
)
bodies = st.dictionaries(st.sampled_from(TOP_KEYS), top_values, max_size=7) | json_values


@settings(max_examples=600, deadline=None, database=None)
@given(bodies)
def test_fuzz_never_raises_anything_but_validation_error(body: Any) -> None:
    try:
        out = norm(body)
    except ValidationError as e:
        assert e.field and str(e).startswith(e.field)
        return
    assert out.items
    for it in out.items:
        assert it.input_ids and all(0 <= t < VOCAB for t in it.input_ids)
        assert len(it.input_ids) + it.sampling_params.max_new_tokens <= CTX


def test_batch_items_are_prompts_times_n_and_bounded_before_any_work() -> None:
    tokenized: list[str] = []

    def spy(text: str) -> list[int]:
        tokenized.append(text)
        return tokenize(text)

    ok = {"text": ["a"] * 4, "sampling_params": {"n": 4}}
    assert len(normalize_generate_request(ok, LIMITS, spy).items) == 4
    tokenized.clear()
    with pytest.raises(ValidationError, match=r"^text asks for 5 prompt\(s\) x n = 20 sequences, more than "
                                             r"--max-batch-items \(16\)"):
        normalize_generate_request({"text": ["a"] * 5, "sampling_params": {"n": 4}}, LIMITS, spy)
    with pytest.raises(ValidationError, match=r"^input_ids asks for 17 prompts"):
        norm({"input_ids": [[1]] * 17})
    assert tokenized == []


def test_text_too_long_for_the_context_is_refused_without_tokenizing() -> None:
    def never(text: str) -> list[int]:
        raise AssertionError("tokenized")

    body = {"text": "x" * (4 * CTX + 1)}
    with pytest.raises(ValidationError, match=r"^text has 257 characters; no text longer than 256 fits"):
        normalize_generate_request(body, LIMITS, never)


def test_ids_too_long_for_the_context_are_refused_without_reading_each_id() -> None:
    """A gRPC message or HTTP body of tens of millions of ids was checked id by id (seconds of
    the GIL, stalling every stream) before its length was; under --allow-auto-truncate the ids
    are still read, as the head is kept."""
    class Unread(list):
        def __iter__(self):
            raise AssertionError("every id was read")

    with pytest.raises(ValidationError, match=r"^input_ids has 64 tokens; a prompt must be shorter than the context"):
        norm({"input_ids": Unread([1] * CTX)})
    with pytest.raises(AssertionError, match="every id was read"):
        norm({"input_ids": Unread([1] * CTX)}, allow_auto_truncate=True)


def test_top_logprobs_num_is_capped_by_the_server() -> None:
    assert norm({"text": "a", "top_logprobs_num": 5}, max_top_logprobs_num=5).items[0].logprob.top_logprobs_num == 5
    with pytest.raises(ValidationError, match=r"^top_logprobs_num must be in \[0, 5\] \(--max-top-logprobs-num\)"):
        norm({"text": "a", "top_logprobs_num": 6}, max_top_logprobs_num=5)


def test_token_ids_logprob_shares_the_per_position_cap() -> None:
    # each id is a logprob at every position of every choice: unbounded, one request could ask for
    # millions of columns (gigabytes of logprobs)
    ok = norm({"text": "a", "token_ids_logprob": [1, 2, 3]}, max_top_logprobs_num=3)
    assert ok.items[0].logprob.token_ids_logprob == (1, 2, 3)
    with pytest.raises(ValidationError, match=r"^token_ids_logprob at most 3 token ids \(--max-top-logprobs-num\), got 4"):
        norm({"text": "a", "token_ids_logprob": [1, 2, 3, 3]}, max_top_logprobs_num=3)
    with pytest.raises(ValidationError, match=r"^token_ids_logprob\[1\] at most 3"):
        norm({"text": ["a", "b"], "token_ids_logprob": [[1], [0] * 4]}, max_top_logprobs_num=3)


def test_batch_token_ids_logprob_may_start_with_null() -> None:
    a, b = norm({"text": ["a", "b"], "token_ids_logprob": [None, [1, 2]]}).items
    assert (a.logprob.token_ids_logprob, b.logprob.token_ids_logprob) == (None, (1, 2))

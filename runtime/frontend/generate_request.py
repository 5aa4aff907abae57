"""GenerateRequest: one request in /generate's terms, as every front end hands it to the
tokenizer manager.

The native API reads it off the JSON body (`from_body`: the handled keys, after the key checks);
the OpenAI, Responses and gRPC adapters fill it directly from their own fields. Its values are
what the client sent, unchecked: `validation.normalize_generate_request` checks every field of it
the same way whichever front end built it, and names the field by its native name (each adapter
maps that back to the name its client used).
"""
from __future__ import annotations

from typing import Any

import msgspec


class GenerateRequest(msgspec.Struct, kw_only=True):
    """The native request fields (SGLang's GenerateReqInput names); None: not given."""

    text: Any = None  # a string, or a batch's list of them
    input_ids: Any = None  # token ids, or a batch's list of them
    sampling_params: Any = None  # the SGLang sampling-params object (a batch may give one per prompt)
    rid: Any = None
    stream: Any = None
    return_logprob: Any = None
    logprob_start_len: Any = None
    top_logprobs_num: Any = None
    token_ids_logprob: Any = None
    return_text_in_logprobs: Any = None
    priority: Any = None
    extra_key: Any = None
    cache_salt: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    return_hidden_states: Any = None
    return_prompt_token_ids: Any = None
    require_reasoning: Any = None
    max_thinking_tokens: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> "GenerateRequest":
        """The handled fields of a native body (its other keys were checked and are dropped)."""
        return cls(**{name: body[name] for name in FIELDS if name in body})

    def fields(self) -> dict[str, Any]:
        """The fields given, as the /generate body that asks for the same request."""
        return {name: value for name in FIELDS if (value := getattr(self, name)) is not None}

    def with_dp_rank(self, rank: int | None) -> "GenerateRequest":
        """SGLang's X-Data-Parallel-Rank header: it wins over routed_dp_rank and data_parallel_rank."""
        if rank is None:
            return self
        return msgspec.structs.replace(self, routed_dp_rank=rank, data_parallel_rank=None)


FIELDS: tuple[str, ...] = GenerateRequest.__struct_fields__

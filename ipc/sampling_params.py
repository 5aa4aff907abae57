"""The sampling parameters a request carries from the tokenizer manager to the scheduler: the
struct only (runtime/sampling/params.py validates a request's JSON into it)."""
from __future__ import annotations

import msgspec

GREEDY_TEMPERATURE = 1e-6
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Validated sampling parameters. Plain (untagged) struct: it rides inside tagged messages."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_regex: list[str] = msgspec.field(default_factory=list)  # Python `re` patterns, searched in the output's tail
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] | None = None
    n: int = 1
    sampling_seed: int | None = None
    stream_interval: int | None = None
    # strict thinking: after this many output tokens still inside the reasoning, the think-end
    # token(s) are forced (needs --enable-strict-thinking)
    max_thinking_tokens: int | None = None
    # guided decoding: at most one is set (`choice` arrives as a regex alternation)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, or None when it is unconstrained."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

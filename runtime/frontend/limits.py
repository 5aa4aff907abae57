"""What one /generate call may ask for: the model's numbers and the server's limits, shared by
the prompt checks and the request validation."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """What one /generate call may ask for (the model's numbers and the server's limits)."""

    vocab_size: int
    context_len: int
    max_total_tokens: int | None = None  # KV slots: a max_new_tokens that is not the client's stops there too
    max_batch_items: int = 4096  # prompts x n per call
    max_top_logprobs_num: int = 20
    # longer text cannot fit the context whatever it tokenizes to: refused before tokenizing
    max_text_chars: int | None = None
    guided_decoding: bool = True  # False with --grammar-backend none: constraints are a 400
    strict_thinking: bool = False  # --enable-strict-thinking: max_thinking_tokens is allowed
    # --reasoning-parser: the server knows where reasoning ends, so require_reasoning can hold a
    # grammar back until then (SGLang wraps the grammar only with a parser)
    reasoning_parser: bool = False
    allow_auto_truncate: bool = False  # --allow-auto-truncate: too long is cut instead of a 400

    @property
    def max_request_len(self) -> int:
        """Prompt + output tokens one request can hold: the context, or the KV pool when smaller."""
        return min(self.context_len, self.max_total_tokens or self.context_len)

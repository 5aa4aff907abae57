"""RequestGrammar: one request's grammar state, with SGLang's reasoner phase in front of it.

Invariant: the xgrammar matcher has accepted exactly the output tokens that came after the
reasoning ended, in order. A request with `require_reasoning` starts in the reasoning phase:
the model writes freely (no mask, the matcher sees nothing) until its output contains the
think-end token sequence (`</think>`; a tokenizer may split it into several tokens, written by
the model or forced by strict thinking); from the next token on the grammar constrains it, as
SGLang's reasoner grammar wrapper does. Without `require_reasoning` the grammar applies from the
first output token.
"""
from __future__ import annotations

from typing import Any


class RequestGrammar:
    def __init__(self, matcher: Any, think_end_ids: tuple[int, ...] | None = None) -> None:
        self._matcher = matcher
        self._think_end = think_end_ids or ()
        self.in_reasoning = bool(self._think_end)
        self._recent: list[int] = []  # the last len(think_end) reasoning tokens

    @property
    def constraining(self) -> Any | None:
        """The xgrammar matcher whose mask this step's token must obey; None while reasoning."""
        return None if self.in_reasoning else self._matcher

    def accept_token(self, token: int) -> bool:
        """False only if the grammar rejects the token (the mask allowed it: a bug upstream)."""
        if not self.in_reasoning:
            return self._matcher.accept_token(token)
        self._recent.append(token)
        del self._recent[:-len(self._think_end)]
        if tuple(self._recent) == self._think_end:
            self.in_reasoning = False
        return True

    def is_terminated(self) -> bool:
        return not self.in_reasoning and self._matcher.is_terminated()

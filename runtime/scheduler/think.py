"""ReasoningState: where a request stands against its think end, the one tracker of it.

Invariant: it has seen exactly the request's kept output tokens, in order (apply_new_tokens
feeds it). `over` once they contain the think-end sequence (`</think>`, which a tokenizer may
split into several tokens); `tokens` counts the outputs up to and including its last token
(SGLang's reasoning_tokens). Three things read it: the grammar of a `require_reasoning`
request starts after the think end, strict thinking (`max_thinking_tokens`) forces the think
end once the budget is spent, and the output counters report `tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReasoningState:
    think_end: tuple[int, ...]
    over: bool = False
    tokens: int = 0
    _recent: list[int] = field(default_factory=list)  # the last len(think_end) outputs while thinking

    def __post_init__(self) -> None:
        self.over = not self.think_end  # no think end known: nothing is reasoning, nothing counts

    def feed(self, token: int) -> None:
        if self.over:
            return
        self.tokens += 1
        self._recent.append(token)
        del self._recent[:-len(self.think_end)]
        self.over = tuple(self._recent) == self.think_end

    def forced_token(self, budget: int, outputs_before: int) -> int:
        """Strict thinking: output number budget + i of a request still thinking is the i-th
        think-end token (-1: sample as usual). A think end the model wrote itself within the
        budget ends it (one step late under overlap: the step in flight is unseen)."""
        if self.over and self.tokens <= budget:
            return -1
        i = outputs_before - budget
        return self.think_end[i] if 0 <= i < len(self.think_end) else -1

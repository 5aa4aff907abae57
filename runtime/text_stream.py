"""What the answer parsers (reasoning, tool calls) share to stream a cumulative answer as deltas.

A parser splits the whole answer so far into parts (reasoning and content; content and calls),
leaving out a tail that could still turn into a tag, and the stream sends what each part grew by
since the last step. Nothing sent is ever taken back, so a split of a longer answer must extend
the split of a shorter one; the held-back tail is what makes that hold at every split point.
"""
from __future__ import annotations

from collections.abc import Iterable


def partial_tag_len(text: str, tags: Iterable[str]) -> int:
    """Length of the longest proper prefix of any of `tags` that `text` ends with: the tail that
    may still grow into a tag, held back until the next text decides it."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class TextCursor:
    """How much of one growing part was sent: `delta` is what the part grew by since the last call."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = 0

    def delta(self, text: str) -> str:
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out

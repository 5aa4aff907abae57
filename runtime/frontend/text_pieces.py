"""TextPieces: a choice's growing answer text, kept as the pieces it arrived in.

Appending is O(piece); reading what follows a cursor is O(that text), so a stream that keeps a
cursor does O(new text) per step however long the answer grows; the whole text is joined only
when a reader asks for it (a cumulative chunk, a finished result), and each join extends the last.
"""
from __future__ import annotations

from bisect import bisect_right


class TextPieces:
    """Invariant: `ends[k]` is the length of pieces[0..k] joined; `_whole` is the first `_count` pieces joined."""

    __slots__ = ("pieces", "ends", "_whole", "_count")

    def __init__(self, text: str = "") -> None:
        self.pieces: list[str] = []
        self.ends: list[int] = []
        self._whole, self._count = "", 0
        self.append(text)

    def append(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            self.ends.append(len(self) + len(piece))

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    def since(self, start: int) -> str:
        """The text from character `start` on."""
        k = bisect_right(self.ends, start)
        if k == len(self.pieces):
            return ""
        head = self.ends[k - 1] if k else 0
        return "".join(self.pieces[k:])[start - head:]

    def whole(self) -> str:
        if self._count < len(self.pieces):
            self._whole += "".join(self.pieces[self._count:])
            self._count = len(self.pieces)
        return self._whole

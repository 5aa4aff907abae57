"""TextPieces: the text after any cursor, and the whole, equal those of the joined pieces, read
in any order (a whole read between appends included)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tandem.runtime.frontend.text_pieces import TextPieces


@given(pieces=st.lists(st.text(max_size=6), max_size=12), reads=st.lists(st.integers(0, 80), max_size=12),
       whole_every=st.integers(1, 4))
def test_reads_equal_the_joined_text(pieces, reads, whole_every):
    text, joined = TextPieces(), ""
    for i, piece in enumerate(pieces):
        text.append(piece)
        joined += piece
        if i % whole_every == 0:
            assert text.whole() == joined
        for start in reads:
            assert text.since(start) == joined[start:]
        assert len(text) == len(joined)
    assert text.whole() == joined


def test_since_reads_within_and_across_pieces():
    text = TextPieces("ab")
    for piece in ["cd"] * 1000:
        text.append(piece)
    assert text.since(len(text) - 2) == "cd" and text.since(3) == "d" + "cd" * 999 and text.since(len(text)) == ""

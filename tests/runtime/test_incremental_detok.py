"""Incremental detokenization against the real SmolLM2 tokenizer."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.runtime.incremental_detok import REPLACEMENT_CHAR, DecodeState, StopTail, decode_batch
from tandem.runtime.tokenizer import load_tokenizer

IM_END = 2
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3:14pm, isn't it?\n  Indented line.",
    "héllo wörld 日本語 🎉🎉 naïve",
    "混合テキスト：한국어, русский, العربية, emoji 👩‍👩‍👧‍👦 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢!",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(None)


class CountingTokenizer:
    """Wraps a tokenizer to count batch_decode calls and record the longest decoded window."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.calls = 0
        self.max_window = 0

    def batch_decode(self, seqs: list[list[int]], **kwargs: Any) -> list[str]:
        self.calls += 1
        self.max_window = max([self.max_window, *(len(s) for s in seqs)])
        return self.tok.batch_decode(seqs, **kwargs)


def stream(state: DecodeState, ids: Sequence[int], chunks: Sequence[int] | None = None) -> list[str]:
    """Feed ids in chunks (default one at a time), finishing with the last chunk."""
    sizes = list(chunks) if chunks is not None else [1] * len(ids)
    deltas, pos = [], 0
    for n, size in enumerate(sizes):
        deltas.append(state.add(ids[pos : pos + size], finished=n == len(sizes) - 1))
        pos += size
    assert pos == len(ids)
    return deltas


def random_chunks(total: int, rng: random.Random) -> list[int]:
    sizes = []
    while total > 0:
        sizes.append(min(total, rng.randint(1, 4)))
        total -= sizes[-1]
    return sizes


# (a) + (b): streaming reproduces a full decode, never emitting U+FFFD mid-stream.
@pytest.mark.parametrize("text", TEXTS)
def test_stream_one_token_at_a_time_matches_full_decode(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    state = DecodeState(tokenizer=tok)
    deltas = stream(state, ids)
    assert "".join(deltas) == state.text == tok.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_split_multibyte_chars_are_held_back(tok: Any) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1  # the emoji's bytes span several tokens
    state = DecodeState(tokenizer=tok)
    assert [state.add([i], finished=False) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert state.add(ids[-1:], finished=False) == "🎉"
    assert state.add([], finished=True) == ""


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking_matches_full_decode(tok: Any, seed: int) -> None:
    rng = random.Random(seed)
    ids = tok.encode(" ".join(TEXTS))
    state = DecodeState(tokenizer=tok)
    deltas = stream(state, ids, random_chunks(len(ids), rng))
    assert "".join(deltas) == tok.decode(ids)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_finish_flushes_incomplete_char(tok: Any) -> None:
    ids = tok.encode("ok 🎉")
    head = ids[:-1]  # drops the token completing the last character
    assert tok.decode(head).endswith(REPLACEMENT_CHAR)
    state = DecodeState(tokenizer=tok)
    deltas = [state.add([i], finished=False) for i in head]
    assert REPLACEMENT_CHAR not in "".join(deltas)
    deltas.append(state.add([], finished=True))
    assert "".join(deltas) == state.text == tok.decode(head)


def test_invalid_byte_mid_stream_is_released_by_next_token(tok: Any) -> None:
    lone = tok.encode("🎉")[-1]  # a continuation byte on its own: genuinely invalid UTF-8
    ids = tok.encode("a") + [lone] + tok.encode(" b")
    state = DecodeState(tokenizer=tok)
    deltas = stream(state, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith(" b") and state.surrogate_offset > 0


def test_add_after_finish_emits_nothing(tok: Any) -> None:
    state = DecodeState(tokenizer=tok)
    state.add(tok.encode("done"), finished=True)
    assert state.finished and state.add(tok.encode(" more"), finished=True) == ""
    assert state.text == "done"


# (c) special tokens.
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Any, skip: bool) -> None:
    ids = tok.encode("Hello there") + [IM_END] + tok.encode(" after")
    state = DecodeState(tokenizer=tok, skip_special_tokens=skip)
    deltas = stream(state, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in state.text) is not skip


# (d) stops: the scheduler decides (it ends a request at the token completing a stop and passes
# FinishReason.matched); the state trims what it matched, as SGLang's detokenizer does.
STOP_TEXT = "The answer is 42. STOP here and then more text follows."


def ids_through(tok: Any, text: str, stop: str) -> list[int]:
    """The tokens of `text` up to the one that completes `stop`: where the scheduler ends it."""
    ids = tok.encode(text)
    for n in range(1, len(ids) + 1):
        if stop in tok.decode(ids[:n]):
            return ids[:n]
    raise AssertionError(f"{stop!r} is not in {text!r}")


def stream_to_stop(state: DecodeState, ids: Sequence[int], matched: int | str,
                   chunks: Sequence[int] | None = None) -> list[str]:
    """Like stream(), with the last chunk finishing on `matched`."""
    sizes = list(chunks) if chunks is not None else [1] * len(ids)
    deltas, pos = [], 0
    for n, size in enumerate(sizes):
        last = n == len(sizes) - 1
        deltas.append(state.add(ids[pos : pos + size], finished=last, matched=matched if last else None))
        pos += size
    return deltas


@pytest.mark.parametrize("chunked", [False, True])
def test_stop_string_trimmed(tok: Any, chunked: bool) -> None:
    stop = "STOP here"
    ids = ids_through(tok, STOP_TEXT, stop)
    state = DecodeState(tokenizer=tok, stop_strings=[stop])
    chunks = random_chunks(len(ids), random.Random(1)) if chunked else None
    deltas = stream_to_stop(state, ids, stop, chunks)
    assert state.text == "".join(deltas) == "The answer is 42. "
    assert "S" not in "".join(deltas)  # not even the stop string's first letter leaked


def test_stop_string_kept_with_no_stop_trim(tok: Any) -> None:
    ids = ids_through(tok, STOP_TEXT, "STOP here")
    state = DecodeState(tokenizer=tok, stop_strings=["STOP here"], no_stop_trim=True)
    deltas = stream_to_stop(state, ids, "STOP here")
    assert state.text == "".join(deltas) == "The answer is 42. STOP here"


def test_no_stop_trim_keeps_the_whole_last_token_when_the_stop_ends_inside_it(tok: Any) -> None:
    # " is" completes "answer i": as SGLang's, no_stop_trim returns the output's whole text, which
    # is what its output_ids decode to, not the text cut at the stop string's end
    ids = ids_through(tok, "The answer is 42.", "answer i")
    assert tok.decode(ids).endswith("answer is")
    for chunks in (None, [len(ids)]):
        state = DecodeState(tokenizer=tok, stop_strings=["answer i"], no_stop_trim=True)
        assert "".join(stream_to_stop(state, ids, "answer i", chunks)) == state.text == "The answer is"


def test_stop_string_the_scheduler_did_not_stop_at_is_text(tok: Any) -> None:
    # a stop string the scheduler did not end on (the last allowed token ends by length) is text
    ids = tok.encode(STOP_TEXT)
    state = DecodeState(tokenizer=tok, stop_strings=["STOP here"])
    deltas = [state.add([i], finished=False) for i in ids[:-1]]
    deltas.append(state.add(ids[-1:], finished=True))  # ends by length
    assert state.text == "".join(deltas) == STOP_TEXT


def test_stop_string_cut_where_it_completes_after_an_ignored_one(tok: Any) -> None:
    # "x" inside min_new_tokens is text; the request stops at the second "x"
    ids = ids_through(tok, "a x b x c", " b x")
    state = DecodeState(tokenizer=tok, stop_strings=["x"])
    deltas = [state.add([i], finished=False) for i in ids[:-1]]
    deltas.append(state.add(ids[-1:], finished=True, matched="x"))
    assert state.text == "".join(deltas) == "a x b "


@pytest.mark.parametrize("first", [0, 1, 3])
def test_an_ignored_stop_string_in_the_final_message_is_text(tok: Any, first: int) -> None:
    # non-streamed output (or stream_interval > 1) arrives in one or few messages: the cut is at
    # the occurrence the last token completes, not at one written inside min_new_tokens
    ids = ids_through(tok, "a x b x c", " b x")
    state = DecodeState(tokenizer=tok, stop_strings=["x"])
    text = state.add(ids[:first], finished=False) + state.add(ids[first:], finished=True, matched="x")
    assert text == state.text == "a x b "
    kept = DecodeState(tokenizer=tok, stop_strings=["x"], no_stop_trim=True)
    assert kept.add(ids, finished=True, matched="x") == "a x b x"


@pytest.mark.parametrize("text, stop", [("party 🎉 time", "🎉"), ("ok 日本語 then", "日本語"), ("a 𝄞 b", "𝄞")])
def test_a_stop_string_ending_in_a_character_split_over_tokens_is_cut(tok: Any, text: str, stop: str) -> None:
    ids = ids_through(tok, text, stop)
    assert tok.decode(ids[:-1]).endswith(REPLACEMENT_CHAR)  # the last token completes the character
    state = DecodeState(tokenizer=tok, stop_strings=[stop])
    assert "".join(stream_to_stop(state, ids, stop)) == state.text == text[:text.index(stop)]
    whole = DecodeState(tokenizer=tok, stop_strings=[stop])
    assert whole.add(ids, finished=True, matched=stop) == text[:text.index(stop)]


def test_the_matched_stop_string_is_the_one_cut(tok: Any) -> None:
    # the scheduler reports which stop ended the request; the text ends where that one starts
    for matched, want in (("abcd", "x"), ("bc", "xa")):
        state = DecodeState(tokenizer=tok, stop_strings=["abcd", "bc"])
        state.add(tok.encode("xabcd"), finished=True, matched=matched)
        assert state.text == want


def test_stop_token_text_is_trimmed(tok: Any) -> None:
    ids = tok.encode("Hello world.")
    period = ids[-1]
    assert tok.decode([period]) == "."
    state = DecodeState(tokenizer=tok)
    assert "".join(stream_to_stop(state, ids, period)) == "Hello world"
    kept = DecodeState(tokenizer=tok, no_stop_trim=True)
    assert "".join(stream_to_stop(kept, ids, period)) == "Hello world."


def test_eos_text_is_trimmed_even_when_specials_are_kept(tok: Any) -> None:
    ids = tok.encode("Hi there") + [IM_END]
    state = DecodeState(tokenizer=tok, skip_special_tokens=False)
    assert state.add(ids, finished=True, matched=IM_END) == "Hi there"
    length = DecodeState(tokenizer=tok, skip_special_tokens=False)  # a length finish keeps it
    assert length.add(ids, finished=True) == "Hi there<|im_end|>"


# (e) partial stop-string prefixes are held back, then released.
def test_partial_stop_prefix_held_then_released(tok: Any) -> None:
    stop = "STOP now"
    ids = tok.encode("We STOP later, fine.")
    state = DecodeState(tokenizer=tok, stop_strings=[stop])
    helds = []
    for i in ids:
        state.add([i], finished=False)
        full = tok.decode(state.ids)
        assert full.startswith(state.text)
        helds.append(full[len(state.text) :])
        assert helds[-1] == "" or stop.startswith(helds[-1])  # only a possible stop start
    assert "STOP" in helds and "ST" in helds  # " ST" then "OP" arrive as separate tokens
    assert state.text == "We STOP later, fine."


def test_partial_stop_prefix_released_on_finish(tok: Any) -> None:
    state = DecodeState(tokenizer=tok, stop_strings=["<END>"])
    assert state.add(tok.encode("value <EN"), finished=False) == "value "
    assert state.add([], finished=True) == "<EN"
    assert state.text == "value <EN"


class CountingStr(str):
    """A stop string that counts the characters read out of it."""

    reads = 0

    def __getitem__(self, key: Any) -> str:
        part = str.__getitem__(self, key)
        self.reads += len(part)
        return part


def test_holding_back_a_long_stop_prefix_costs_each_step_only_its_new_text(tok: Any) -> None:
    """The held-back tail is found by a matcher fed only the new text: trying every tail length
    against each stop at every step grew with the text (32 stops of 10k characters: 50 ms a step
    of the detokenizer, for every request behind it)."""
    text = " ".join(TEXTS) * 3
    stop = CountingStr(text + " and then some")  # every prefix of the output is a prefix of it
    state = DecodeState(tokenizer=tok, stop_strings=[stop])
    assert all(state.add([i], finished=False) == "" for i in tok.encode(text))  # all of it held back
    assert state.add([], finished=True) == text  # a finish without the stop releases it
    assert stop.reads <= 4 * len(text)


def held_by_definition(text: str, stop: str) -> int:
    """The longest tail of `text` that is a proper prefix of `stop`, tried length by length."""
    return max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(stop=st.text("ab", min_size=1, max_size=8), pieces=st.lists(st.text("abc", max_size=6), max_size=12))
def test_stop_tail_holds_what_the_definition_holds(stop: str, pieces: list[str]) -> None:
    """After every piece of streamed text, the matcher's held length is the definition's (a
    two-letter alphabet makes borders, and so the failure links, common)."""
    tail, text = StopTail(stop), ""
    for piece in pieces:
        tail.feed(piece)
        text += piece
        assert tail.held == held_by_definition(text, stop)


# (f) batch helper equals per-state decoding, with one batch_decode per option group.
def make_states(tok: Any | None) -> list[DecodeState]:
    return [
        DecodeState(tokenizer=tok),
        DecodeState(tokenizer=tok, stop_strings=["STOP here"]),
        DecodeState(tokenizer=tok, skip_special_tokens=False),
        DecodeState(tokenizer=tok, stop_strings=["lazy"], no_stop_trim=True),
    ]


def test_batch_matches_per_state(tok: Any) -> None:
    streams = [
        tok.encode(TEXTS[1]),
        ids_through(tok, STOP_TEXT, "STOP here"),
        tok.encode("chat") + [IM_END] + tok.encode(TEXTS[2]),
        ids_through(tok, TEXTS[0], "lazy"),
    ]
    finish_on = [None, "STOP here", None, "lazy"]
    rng = random.Random(7)
    plans = [random_chunks(len(ids), rng) for ids in streams]
    steps = max(len(p) for p in plans)

    solo = make_states(tok)
    batched = make_states(None)
    counting = CountingTokenizer(tok)
    pos = [0] * len(streams)
    solo_out: list[list[str]] = [[] for _ in streams]
    batch_out: list[list[str]] = [[] for _ in streams]
    for step in range(steps):
        chunks, fins, matched = [], [], []
        for r, plan in enumerate(plans):
            size = plan[step] if step < len(plan) else 0
            chunks.append(streams[r][pos[r] : pos[r] + size])
            fins.append(step >= len(plan) - 1)
            matched.append(finish_on[r] if fins[-1] else None)
            pos[r] += size
        before = counting.calls
        deltas = decode_batch(counting, batched, chunks, fins, matched)
        assert counting.calls - before <= 2  # two option groups: skip True / skip False
        for r in range(len(streams)):
            solo_out[r].append(solo[r].add(chunks[r], fins[r], matched[r]))
            batch_out[r].append(deltas[r])
    assert batch_out == solo_out
    assert [s.text for s in batched] == [s.text for s in solo]
    assert batched[1].text == "The answer is 42. " and batched[3].text.endswith("lazy")


def test_batch_validates_lengths(tok: Any) -> None:
    with pytest.raises(ValueError):
        decode_batch(tok, [DecodeState()], [], [False])
    with pytest.raises(ValueError):
        decode_batch(tok, [DecodeState()], [[1]], [True], [])
    with pytest.raises(ValueError):
        DecodeState().add([1], finished=False)


# (g) the per-step decode window stays bounded however long the output gets.
def test_decode_window_stays_bounded(tok: Any) -> None:
    ids = (tok.encode(" ".join(TEXTS)) * 10)[:300]
    assert len(ids) >= 200
    counting = CountingTokenizer(tok)
    state = DecodeState()
    for n, i in enumerate(ids):
        decode_batch(counting, [state], [[i]], [False])
        assert len(state.ids) - state.surrogate_offset <= 8
        if n >= 200:
            assert state.surrogate_offset > 190
    assert counting.max_window <= 8
    decode_batch(counting, [state], [[]], [True])
    assert state.text == tok.decode(ids)


def _sentencepiece_style() -> Any:
    """A Llama-2/Mistral-style decoder: "▁" is a space and one leading space of a decode is dropped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁The": 3, "▁capital": 4, "▁is": 5, "▁Paris": 6, ".": 7, "▁P": 8,
             "aris": 9, "<0xF0>": 10, "<0x9F>": 11, "<0x8E>": 12, "<0x89>": 13, "!": 14}
    spec = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    spec.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=spec, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("chunks", [[[6, 7, 2]], [[6], [7], [2]]])
def test_the_first_output_token_is_decoded_after_the_prompts_tail(chunks: list[list[int]]) -> None:
    """As SGLang: with the prompt's last tokens as context, "▁Paris" keeps its space (decoded
    alone, a SentencePiece decoder drops it); the context itself is never shown."""
    sp_tok = _sentencepiece_style()
    state = DecodeState(tokenizer=sp_tok, context_ids=[1, 3, 4, 5])
    text = "".join(state.add(c, i == len(chunks) - 1, 2 if i == len(chunks) - 1 else None) for i, c in enumerate(chunks))
    assert text == " Paris." and DecodeState(tokenizer=sp_tok).add([6, 7], True) == "Paris."


def test_a_stop_string_is_cut_in_the_output_not_the_context() -> None:
    sp_tok = _sentencepiece_style()
    state = DecodeState(tokenizer=sp_tok, context_ids=[1, 3, 4, 5], stop_strings=["aris"])
    assert state.add([8], False) + state.add([9], True, "aris") == " P"


def test_a_prompt_tail_ending_inside_a_character_leaves_the_output_whole() -> None:
    """A byte-fallback decoder writes one U+FFFD per byte of the tail's unfinished character, and
    one character once the output completes it: the output text starts after the tail's whole
    characters, so nothing the model wrote is cut (the completed emoji shows with it)."""
    state = DecodeState(tokenizer=_sentencepiece_style(), context_ids=[1, 3, 10, 11])
    text = "".join(state.add([t], i == 3) for i, t in enumerate([12, 13, 14, 7]))
    assert text == "\N{PARTY POPPER}!."

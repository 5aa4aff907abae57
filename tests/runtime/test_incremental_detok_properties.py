"""Properties of incremental detokenization over token ids drawn from the real SmolLM2 vocabulary,
against Hugging Face's decode as the reference: the text a request ends with is
`decode(output_ids)` (less the matched stop, as SGLang trims it), and every streamed prefix is a
prefix of it (nothing is un-said, no U+FFFD for a character a later token completes)."""
from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tandem.runtime.incremental_detok import REPLACEMENT_CHAR, DecodeState, Matched

VOCAB_SIZE = 49152
SPECIAL_IDS = range(17)  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
BYTE_IDS = range(17, 17 + 256)  # the byte-level alphabet: one byte each
# texts whose characters span several byte-level tokens, and spaces a decode must keep
PIECES = ["🎉", "日本語", "é", "👩‍👩‍👧‍👦", "𝔘", "한국어", " hello", "  ", "\n\n", "ab", "a b"]
STOPS = ["a", "ab", " ", "🎉", "語", "b a", "<|im_end|>", "\n\n", "hello", "llo w", REPLACEMENT_CHAR]
PROMPTS = ["", "Hi", " there", "日本", "<|im_start|>assistant\n"]
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def token_runs(tok: Any) -> st.SearchStrategy[list[int]]:
    """Arbitrary ids, byte tokens, special tokens, and the tokens of multi-byte characters."""
    run = st.one_of(st.integers(0, VOCAB_SIZE - 1).map(lambda t: [t]), st.sampled_from(BYTE_IDS).map(lambda t: [t]),
                    st.sampled_from(SPECIAL_IDS).map(lambda t: [t]), st.sampled_from(PIECES).map(tok.encode))
    return st.lists(run, min_size=1, max_size=12).map(lambda runs: [t for r in runs for t in r])


def scheduler_stop(tok: Any, ids: list[int], stops: list[str]) -> tuple[list[int], Matched]:
    """The output the scheduler keeps, and the stop it ends on: the first token after which a
    stop string is in the text (its decode keeps special tokens)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if (hit := next((s for s in stops if s in text), None)) is not None:
            return ids[:k], hit
    return ids, None


def expected_text(tok: Any, ids: list[int], matched: Matched, skip: bool, spaces: bool, no_stop_trim: bool) -> str:
    """decode(output_ids), cut where the stop string the last token completed starts."""
    full = tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    if not isinstance(matched, str) or no_stop_trim:
        return full
    before = len(tok.decode(ids[:-1], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
                 .rstrip(REPLACEMENT_CHAR))  # a character the last token completes is its own
    starts = [p for p in range(len(full)) if full.startswith(matched, p) and p + len(matched) > before]
    return full[:starts[0]] if starts else full


def stream(state: DecodeState, ids: list[int], matched: Matched, rng: random.Random) -> list[str]:
    """Feed ids in chunks of 1-3 (as steps, speculative ones included, deliver them); return the
    text shown after each step."""
    shown, pos, texts = "", 0, []
    while pos < len(ids):
        chunk = ids[pos:pos + rng.randint(1, 3)]
        pos += len(chunk)
        finished = pos == len(ids)
        shown += state.add(chunk, finished, matched if finished else None)
        texts.append(shown)
    return texts


@PROPERTY_SETTINGS
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans(), no_stop_trim=st.booleans(),
       stops=st.lists(st.sampled_from(STOPS), max_size=2), prompt=st.sampled_from(PROMPTS),
       rng=st.randoms(use_true_random=False))
def test_streamed_text_is_the_decode_of_the_output_ids(smol_tokenizer: Any, data: st.DataObject, skip: bool,
                                                       spaces: bool, no_stop_trim: bool, stops: list[str],
                                                       prompt: str, rng: random.Random) -> None:
    tok = smol_tokenizer
    ids, matched = scheduler_stop(tok, data.draw(token_runs(tok)), stops)
    state = DecodeState(tokenizer=tok, skip_special_tokens=skip, spaces_between_special_tokens=spaces,
                        stop_strings=stops, no_stop_trim=no_stop_trim, context_ids=tok.encode(prompt)[-5:])
    texts = stream(state, ids, matched, rng)
    final = expected_text(tok, ids, matched, skip, spaces, no_stop_trim)
    assert texts[-1] == state.text == final
    assert all(final.startswith(text) for text in texts)


@PROPERTY_SETTINGS
@given(data=st.data(), tail=st.sampled_from(["🎉", "日", "é"]), cut=st.integers(1, 3), skip=st.booleans(),
       rng=st.randoms(use_true_random=False))
def test_a_prompt_ending_inside_a_character_adds_no_replacement_char(smol_tokenizer: Any, data: st.DataObject,
                                                                     tail: str, cut: int, skip: bool,
                                                                     rng: random.Random) -> None:
    """A prompt given as ids may end inside a character. An output that does not complete it
    (its text starts with a character of its own) is decode(output_ids): no U+FFFD in front
    for the prompt's bytes, as SGLang's decode after the prompt's tail."""
    tok = smol_tokenizer
    tail_ids = tok.encode(tail)
    prompt = tok.encode("Say")[-4:] + tail_ids[:max(1, len(tail_ids) - cut)]
    ids = data.draw(token_runs(tok))
    expected = tok.decode(ids, skip_special_tokens=skip)
    assume(not expected.startswith(REPLACEMENT_CHAR))  # else its first byte may continue the prompt's character
    state = DecodeState(tokenizer=tok, skip_special_tokens=skip, context_ids=prompt)
    assert stream(state, ids, None, rng)[-1] == expected


def test_an_output_completing_the_prompts_last_character_shows_it(smol_tokenizer: Any) -> None:
    tok = smol_tokenizer
    emoji = tok.encode("🎉")
    state = DecodeState(tokenizer=tok, context_ids=tok.encode("Say")[-4:] + emoji[:1])
    assert state.add(emoji[1:], False) + state.add(tok.encode("!"), True) == "🎉!"

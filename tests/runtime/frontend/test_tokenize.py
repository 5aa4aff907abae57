"""SGLang's /tokenize and /detokenize bodies (runtime/frontend/tokenize.py), process-free: the
served tokenizer's ids and text, lists for lists, and a 400 naming the field for anything else."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tandem.runtime.frontend.tokenize import detokenize, tokenize
from tandem.runtime.value_checks import ValidationError


@pytest.fixture(scope="module")
def tm(smol_tokenizer):
    return SimpleNamespace(tokenizer=smol_tokenizer, model_info={"context_len": 8192, "vocab_size": 49152})


def run(coro):
    return asyncio.run(coro)


def test_a_prompt_and_a_list_of_prompts_give_the_tokenizers_ids(tm, smol_tokenizer):
    ids = smol_tokenizer.encode("Hello world", add_special_tokens=True)
    assert run(tokenize(tm, {"prompt": "Hello world"})) == {"tokens": ids, "count": len(ids), "max_model_len": 8192}
    both = run(tokenize(tm, {"model": "default", "prompt": ["Hello world", "Hi"], "add_special_tokens": False}))
    hi = smol_tokenizer.encode("Hi", add_special_tokens=False)
    assert both == {"tokens": [smol_tokenizer.encode("Hello world", add_special_tokens=False), hi],
                    "count": [len(ids), len(hi)], "max_model_len": 8192}


def test_ids_and_lists_of_ids_decode_back(tm, smol_tokenizer):
    ids = smol_tokenizer.encode("Hello world")
    assert run(detokenize(tm, {"tokens": ids})) == {"text": "Hello world"}
    assert run(detokenize(tm, {"tokens": [ids, ids[:1]]})) == {"text": ["Hello world", "Hello"]}
    assert run(detokenize(tm, {"tokens": []})) == {"text": ""}
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert run(detokenize(tm, {"tokens": [im_end], "skip_special_tokens": False})) == {"text": "<|im_end|>"}
    assert run(detokenize(tm, {"tokens": [im_end]})) == {"text": ""}


@pytest.mark.parametrize("route, body, field", [
    (tokenize, [], "body"),
    (tokenize, {}, "prompt"),
    (tokenize, {"prompt": 5}, "prompt"),
    (tokenize, {"prompt": ["a", 1]}, "prompt"),
    (tokenize, {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    (tokenize, {"prompt": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    (tokenize, {"prompt": "a", "model": 3}, "model"),
    (detokenize, {"tokens": "12"}, "tokens"),
    (detokenize, {"tokens": [1, -1]}, "tokens[1]"),
    (detokenize, {"tokens": [1, True]}, "tokens[1]"),
    (detokenize, {"tokens": [[1], [2, 49152]]}, "tokens[1][1]"),
    (detokenize, {"tokens": [[1], 2]}, "tokens[1]"),
    (detokenize, {"tokens": [1], "skip_special_tokens": 1}, "skip_special_tokens"),
])
def test_bad_bodies_are_refused_naming_the_field(tm, route, body, field):
    with pytest.raises(ValidationError) as err:
        run(route(tm, body))
    assert err.value.field == field

"""Prompt sets for `tandem bench serving`: random, generated-shared-prefix, local conversations.

A prompt is either text (sent as "text") or a list of token ids (sent as "input_ids"). Without a
tokenizer, synthetic prompts are token ids drawn from [FIRST_ORDINARY_ID, vocab), which keeps
the harness free of model files; with `--tokenizer` they are decoded into text, as SGLang does.
Every sampler takes its own seeded generator so a given `--seed` always yields the same set.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# ids below this are left out of random prompts: tokenizers put BOS/EOS/PAD/etc. there
FIRST_ORDINARY_ID = 17

USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "model")


@dataclass
class DatasetRow:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class _HFTokenizer:
    """Adapter over a `transformers` tokenizer: no special tokens added, plain lists of ints."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.vocab_size = int(tok.vocab_size)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class _FileTokenizer:
    """Adapter over a bare `tokenizers` tokenizer.json."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        self._tok = RawTokenizer.from_file(path)
        self.vocab_size = int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(path: str | None) -> Tokenizer | None:
    """A tokenizer.json file or a Hugging Face tokenizer directory/name; None stays None."""
    if not path:
        return None
    if path.endswith(".json"):
        return _FileTokenizer(path)
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    return _HFTokenizer(AutoTokenizer.from_pretrained(path))


def _random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    low = FIRST_ORDINARY_ID if vocab > FIRST_ORDINARY_ID else 0
    return rng.integers(low, vocab, size=n).tolist()


def _as_prompt(ids: list[int], tokenizer: Tokenizer | None) -> str | list[int]:
    return tokenizer.decode(ids) if tokenizer is not None else ids


def sample_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    vocab_size: int,
    tokenizer: Tokenizer | None = None,
) -> list[DatasetRow]:
    """Lengths uniform in [len * ratio, len] (SGLang's range), ids uniform over the vocab.

    With a tokenizer the ids are decoded to text and prompt_len stays the sampled length,
    as in SGLang; the server's own prompt_tokens count is what the metrics use when reported.
    """
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size if tokenizer is not None else vocab_size
    in_lens = rng.integers(max(int(input_len * range_ratio), 1), input_len + 1, size=num_prompts)
    out_lens = rng.integers(max(int(output_len * range_ratio), 1), output_len + 1, size=num_prompts)
    rows = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        ids = _random_ids(rng, n_in, vocab)
        rows.append(DatasetRow(_as_prompt(ids, tokenizer), n_in, n_out))
    return rows


def sample_generated_shared_prefix(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    vocab_size: int,
    tokenizer: Tokenizer | None = None,
) -> list[DatasetRow]:
    """Groups of prompts = one random system prefix per group + a random question each.

    Prompts are shuffled across groups (as SGLang does) so a prefix cache, not arrival order,
    is what makes the shared prefixes cheap.
    """
    rng = np.random.default_rng(seed)
    vocab = tokenizer.vocab_size if tokenizer is not None else vocab_size
    rows = []
    for _ in range(num_groups):
        system = _random_ids(rng, system_prompt_len, vocab)
        system_text = tokenizer.decode(system) if tokenizer is not None else ""
        for _ in range(prompts_per_group):
            question = _random_ids(rng, question_len, vocab)
            if tokenizer is None:
                rows.append(DatasetRow(system + question, len(system) + len(question), output_len))
                continue
            text = f"{system_text}\n\n{tokenizer.decode(question)}"
            rows.append(DatasetRow(text, len(tokenizer.encode(text)), output_len))
    random.Random(seed).shuffle(rows)
    return rows


def _read_records(path: str) -> list[dict[str, Any]]:
    """A JSON list (ShareGPT dump) or JSON Lines, told apart by the first non-blank char."""
    raw = Path(path).read_text(encoding="utf-8")
    if raw.lstrip().startswith("["):
        return list(json.loads(raw))
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def _turn(msg: dict[str, Any]) -> tuple[str, str]:
    role = str(msg.get("from", msg.get("role", ""))).lower()
    return role, str(msg.get("value", msg.get("content", "")))


def first_exchange(record: dict[str, Any]) -> tuple[str, str] | None:
    """(first user turn, first assistant turn after it), or None when the record lacks one."""
    turns = [_turn(m) for m in record.get("conversations", record.get("conversation", []))]
    user_at = next((i for i, (r, _) in enumerate(turns) if r in USER_ROLES), None)
    if user_at is None:
        return None
    reply = next((t for r, t in turns[user_at + 1 :] if r in ASSISTANT_ROLES), None)
    return None if reply is None else (turns[user_at][1], reply)


def _count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    # whitespace words approximate tokens well enough to size requests without a tokenizer
    return len(tokenizer.encode(text)) if tokenizer is not None else len(text.split())


def load_conversations(
    path: str,
    num_prompts: int,
    seed: int,
    tokenizer: Tokenizer | None = None,
    fixed_output_len: int | None = None,
    context_len: int | None = None,
) -> list[DatasetRow]:
    """ShareGPT-style records: first user turn is the prompt, its reply sets the output length.

    Like SGLang, records are shuffled with the seed and too-short pairs (< 2 tokens either
    side, unless the output length is fixed) or pairs over `context_len` are skipped.
    """
    pairs = [p for p in map(first_exchange, _read_records(path)) if p is not None]
    random.Random(seed).shuffle(pairs)
    rows: list[DatasetRow] = []
    for prompt, reply in pairs:
        if len(rows) == num_prompts:
            break
        n_in = _count_tokens(prompt, tokenizer)
        n_out = fixed_output_len or _count_tokens(reply, tokenizer)
        if n_in < 2 or n_out < 2 or (context_len and n_in + n_out > context_len):
            continue
        rows.append(DatasetRow(prompt, n_in, n_out))
    return rows


def get_dataset(args: Any, tokenizer: Tokenizer | None) -> list[DatasetRow]:
    """Build the prompt set the parsed CLI arguments ask for."""
    name = args.dataset_name
    if name == "random":
        return sample_random(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, args.seed, args.vocab_size, tokenizer)
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix(
            args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
            args.gsp_question_len, args.gsp_output_len, args.seed, args.vocab_size, tokenizer)
    if name in ("sharegpt", "jsonl"):
        if not args.dataset_path:
            raise ValueError(f"--dataset-name {name} needs --dataset-path (no downloads)")
        return load_conversations(args.dataset_path, args.num_prompts, args.seed, tokenizer,
                                  args.sharegpt_output_len, args.sharegpt_context_len)
    raise ValueError(f"unknown dataset {name!r}")

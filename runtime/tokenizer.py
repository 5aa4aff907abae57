"""Tokenizer and chat template through transformers' AutoTokenizer (HF folders and GGUF files alike)."""
from __future__ import annotations

import os
from functools import lru_cache

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tandem.runtime.model.loader import cache_dir, file_cache_key, is_gguf, resolve_model_path


@lru_cache(maxsize=4)
def load_tokenizer(model_path: str | None) -> PreTrainedTokenizerBase:
    """Converting a GGUF tokenizer takes seconds; the converted one is saved once in the cache dir."""
    path = resolve_model_path(model_path)
    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(path)
    saved = cache_dir() / f"tokenizer-{file_cache_key(path)}"
    if (saved / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tmp = saved.with_name(f"{saved.name}.tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, saved)
    except OSError:
        pass  # another process won the race, or the cache is read-only
    return tok

"""Tokenizer loading, the same in every process: transformers' fast tokenizer over tokenizer.json.

`PreTrainedTokenizerFast` is used rather than `AutoTokenizer` because AutoTokenizer imports
transformers' configuration code, which imports torch, and the HTTP / tokenizer-manager process
stays torch-free. A GGUF file's tokenizer is converted once by transformers' GGUF reader (which
does need torch) in a short-lived helper process and cached as a tokenizer folder.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.nodes
from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

from tandem.runtime.model_files import cache_dir, file_cache_key, is_gguf, resolve_model_path


@lru_cache(maxsize=4)
def load_tokenizer(model_path: str | None) -> PreTrainedTokenizerFast:
    path = resolve_model_path(model_path)
    if not is_gguf(path):
        return PreTrainedTokenizerFast.from_pretrained(path)
    saved = cache_dir() / f"tokenizer-{file_cache_key(path)}"
    if not (saved / "tokenizer_config.json").is_file():
        _convert_in_helper(path, saved)
    return PreTrainedTokenizerFast.from_pretrained(str(saved))


def _convert_in_helper(gguf_path: str, saved: Path) -> None:
    proc = mp.get_context("spawn").Process(target=_convert_gguf_tokenizer, args=(gguf_path, str(saved)),
                                           name="tandem-tokenizer-convert", daemon=True)
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not (saved / "tokenizer_config.json").is_file():
        raise RuntimeError(f"converting the tokenizer of {gguf_path} failed (exit code {proc.exitcode}); "
                           f"is {saved.parent} writable?")


def _convert_gguf_tokenizer(gguf_path: str, saved: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tmp = f"{saved}.tmp{os.getpid()}"
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, saved)  # atomic; a concurrent converter that won the race wrote the same files
    except OSError:
        if not os.path.isdir(saved):
            raise


def max_chars_per_token(tokenizer: PreTrainedTokenizerFast) -> int:
    """The longest text one token stands for (its vocabulary string: bytes for byte-level BPE,
    which is at least the characters): a text longer than context x this cannot fit."""
    return max(len(token) for token in tokenizer.get_vocab())


def read_chat_template(path: str) -> str:
    """A `--chat-template` Jinja file as SGLang loads one: literal `\\n` escapes become newlines
    (a template copied out of a tokenizer_config.json keeps them, and the prompt would hold a
    backslash and an n), and blank lines before it (printed before the prompt) are dropped."""
    return Path(path).read_text().strip("\n").replace("\\n", "\n")


# the names templates give a message in `{% for part in message.content %}` (SGLang's detection)
_MESSAGE_NAMES = ("message", "msg", "m")


def template_content_format(template: str | None) -> str:
    """SGLang's detection: "openai" when the chat template loops over a message's content (it
    takes the list of parts), else "string" (parts are joined into one string for it)."""
    try:
        loops = jinja2.Environment().parse(template or "").find_all(jinja2.nodes.For)
    except jinja2.TemplateSyntaxError:
        return "string"
    return "openai" if any(_is_content(loop.iter) for loop in loops) else "string"


def _is_content(node: jinja2.nodes.Node) -> bool:
    """`message.content` or `message['content']`, also under a filter (`| selectattr(...)`)."""
    while isinstance(node, jinja2.nodes.Filter):
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        name, target = node.attr, node.node
    elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        name, target = node.arg.value, node.node
    else:
        return False
    return name == "content" and isinstance(target, jinja2.nodes.Name) and target.name in _MESSAGE_NAMES

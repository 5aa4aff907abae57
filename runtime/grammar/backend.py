"""GrammarBackend: compiles request grammars with xgrammar, off the scheduler thread.

Compilation runs on the CompilePool's niced threads (xgrammar releases the GIL while it
compiles). Results are cached by (kind, text) as futures, so every request with the same schema
shares one compiled grammar and only the first one waits for it. A failed compile is cached too:
the same bad schema fails at once the next time. The cache is bounded by count and by compiled
bytes (least recently asked for goes first). A compile no request waits for any more is given up
(`release`): cancelled if it has not started, its pool place freed if it has.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import orjson

from tandem.runtime.grammar.compile_pool import CompilePool
from tandem.runtime.sampling.params import ANY_JSON

_CACHE_SIZE = 1024  # distinct grammars kept compiled
# and at most this many bytes of them: a 24 KB schema compiles to 7.5 MB against a 49k vocabulary
# (a 121 KB one to 38 MB), so 1024 distinct schemas held the scheduler at 8-38 GB until it died
_CACHE_BYTES = 1 << 30
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[19:49:01] /project/cpp/x.cc:83: "
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false: ")  # xgrammar's internal assertion, not the cause


class GrammarBackend:
    def __init__(self, tokenizer: Any, vocab_size: int, any_whitespace: bool = True,
                 stop_token_ids: tuple[int, ...] | None = None, compile_threads: int = 1) -> None:
        import xgrammar as xgr  # heavy (and imports torch): only schedulers with guided decoding load it

        self._xgr = xgr
        # the model's EOS ids end a grammar, as SGLang passes them: xgrammar alone would take only
        # the tokenizer's eos_token and mask the others (Llama 3's <|eom_id|>, Qwen's <|endoftext|>)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # cached here instead
        self._pool = CompilePool(compile_threads)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._bytes: dict[tuple[str, str], int] = {}  # compiled size of the cached grammars that are done
        self._buffers: list[Any] = [None, None]
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)  # one C++ call per step, the GIL released
        self._turn = 0
        self.vocab_size = vocab_size
        self._any_whitespace = any_whitespace  # False: no whitespace but one blank after , and :

    def compile(self, kind: str, text: str) -> Future:
        """A future of the compiled grammar; resolves to an exception with xgrammar's message."""
        key = (kind, text)
        fut = self._cache.get(key)
        if fut is None:
            fut = self._cache[key] = self._pool.submit(self._compile, kind, text)
            self._evict()
        else:
            self._cache.move_to_end(key)
        return fut

    def _evict(self) -> None:
        """Least recently asked for first, until the cache is within _CACHE_SIZE grammars and
        _CACHE_BYTES of compiled ones (the newest always stays). Requests holding an evicted
        grammar keep it; the next request for it compiles it again."""
        for key, fut in self._cache.items():
            if key not in self._bytes and fut.done():  # measured once: 0.16 ms for a big grammar
                self._bytes[key] = _compiled_bytes(fut)
        held = sum(self._bytes.values())
        while len(self._cache) > 1 and (len(self._cache) > _CACHE_SIZE or held > _CACHE_BYTES):
            key, _ = self._cache.popitem(last=False)
            held -= self._bytes.pop(key, 0)

    def release(self, kind: str, text: str) -> None:
        """No request waits for this grammar any more (aborted, timed out): a compile that has not
        started is cancelled, as SGLang cancels it, and one running gives its pool place to the
        next (CompilePool.abandon); either is forgotten, so abandoned grammars do not hold the
        pool from the ones requests still wait for. A finished one stays cached."""
        key = (kind, text)
        fut = self._cache.get(key)
        if fut is not None and self._pool.abandon(fut):
            del self._cache[key]
            self._bytes.pop(key, None)

    def matcher(self, compiled: Any) -> Any:
        """A request's own xgrammar matcher of a compiled grammar."""
        return self._xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[Any], bitmask: Any) -> None:
        """Row i of `bitmask`: the tokens xgrammar matcher i allows next; all tokens where it is
        None (a request still reasoning, or a finished one whose sample is thrown away)."""
        live = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        for i in set(range(len(matchers))) - set(live):
            bitmask[i] = -1  # all bits set (the buffer is reused)
        if live:
            self._batch.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, indices=live)

    def bitmask_buffer(self, rows: int) -> Any:
        """A host bitmask of `rows` rows, from two buffers used in turn: a step's mask is applied
        before the mask two steps later is filled, so reuse never races (and allocating a fresh
        one each step cost more than filling it)."""
        self._turn ^= 1
        buf = self._buffers[self._turn]
        have = 0 if buf is None else buf.shape[0]
        if have < rows:
            buf = self._buffers[self._turn] = self._xgr.allocate_token_bitmask(max(rows, 2 * have), self.vocab_size)
        return buf[:rows]

    def _compile(self, kind: str, text: str) -> Any:
        compiled = self._compile_kind(kind, text)
        # a grammar no token can start (a $ref loop, an empty character class) would mask every
        # token of the first step and fail the request there with a 500: it is the client's 400
        matcher = self._xgr.GrammarMatcher(compiled)
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bitmask.any():
            raise ValueError("matches no text: no token can start it")
        return compiled

    def _compile_kind(self, kind: str, text: str) -> Any:
        c = self._compiler
        if kind == "json_schema":
            if text == ANY_JSON:
                return c.compile_builtin_json_grammar()
            # without free whitespace, xgrammar's own separators (", " and ": "), as SGLang compiles it
            return c.compile_json_schema(text, any_whitespace=self._any_whitespace)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "ebnf":
            return c.compile_grammar(text)
        if kind == "structural_tag":
            return self._structural_tag(text)
        raise ValueError(f"unknown grammar kind {kind!r}")

    def _structural_tag(self, text: str) -> Any:
        """SGLang's two JSON forms: the legacy {"structures": [...], "triggers": [...],
        "at_least_one": false} and xgrammar's own structural-tag format; and tandem's tool-call
        form, a model's call format built by xgrammar. A missing or null schema is any JSON
        (`{}`), as SGLang's sanitizing makes it."""
        tag = orjson.loads(text)
        if tag.get("type") == "tool_calls":
            return self._compiler.compile_structural_tag(self._tool_calls_tag(tag))
        if (structures := tag.get("structures")) is not None:
            if not isinstance(structures, list):
                raise ValueError("structures must be a list")
            if not isinstance(at_least_one := tag.get("at_least_one") or False, bool):
                raise ValueError("at_least_one must be a boolean")
            items = [self._structure_item(i, s) for i, s in enumerate(structures)]
            legacy = self._xgr.StructuralTag.from_legacy_structural_tag(items, tag.get("triggers") or [])
            # xgrammar's legacy call has no such argument; true: the output must open with a tag
            legacy.format.at_least_one = at_least_one
            return self._compiler.compile_structural_tag(legacy)
        if isinstance(tag.get("format"), dict):
            _default_schemas(tag["format"])
            text = orjson.dumps(tag).decode()
        return self._compiler.compile_structural_tag(text)

    def _tool_calls_tag(self, tag: dict) -> Any:
        """tandem's tool-call form (runtime/tools/constraint.py): xgrammar's own structural tag for
        a model's call format. Without free whitespace (--constrained-json-disable-any-whitespace)
        the arguments allow one blank at a time, the nearest the tag's JSON has to that setting."""
        for key, kind in (("model", str), ("tools", list), ("parallel_tool_calls", bool)):
            if not isinstance(tag.get(key), kind):
                raise ValueError(f"a tool_calls tag needs {key} ({kind.__name__})")
        return self._xgr.get_model_structural_tag(
            tag["model"], tools=tag["tools"], tool_choice=tag.get("tool_choice", "required"), reasoning="disabled",
            parallel_tool_calls=tag["parallel_tool_calls"], max_whitespace_cnt=None if self._any_whitespace else 1)

    def _structure_item(self, i: int, s: Any) -> Any:
        if not isinstance(s, dict):
            raise ValueError(f"structures[{i}] must be an object")
        for key in ("begin", "end"):
            if not isinstance(s.get(key), str):
                raise ValueError(f"structures[{i}].{key} must be a string")
        schema = {} if s.get("schema") is None else s["schema"]
        return self._xgr.StructuralTagItem(begin=s["begin"], schema=orjson.dumps(schema).decode(), end=s["end"])

    @staticmethod
    def error_message(exc: BaseException) -> str:
        """xgrammar's message without its timestamp and source location."""
        lines = [_XGRAMMAR_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
        lines = [_CHECK_FAILED.sub("", line) for line in lines]
        return " ".join(line for line in lines if line) or type(exc).__name__

    def close(self) -> None:
        self._pool.close()


def _compiled_bytes(fut: Future) -> int:
    """The memory of a compiled grammar (done); 0 when it failed."""
    if fut.cancelled() or fut.exception() is not None:
        return 0
    return fut.result().memory_size_bytes


def _default_schemas(fmt: Any) -> None:
    """In place: every json_schema format without a schema gets `{}`, through tags, sequences and
    alternatives (SGLang's _sanitize_structural_format)."""
    if not isinstance(fmt, dict):
        return
    if fmt.get("type") in ("json_schema", "qwen_xml_parameter") and fmt.get("json_schema") is None:
        fmt["json_schema"] = {}
    children = [fmt.get("content")]
    for key in ("elements", "tags"):  # sequence / or, and triggered_tags / tags_with_separator
        children += fmt[key] if isinstance(fmt.get(key), list) else []
    for child in children:
        _default_schemas(child)

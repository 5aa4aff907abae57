"""Per-request sampling parameters (SGLang names and defaults) and their validation.

Validation happens once, in the tokenizer manager, via `SamplingParams.from_request`. The
scheduler receives an already-valid struct inside `TokenizedGenerateReq` and never re-checks it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import regex

from tandem.ipc.sampling_params import GRAMMAR_KINDS, GREEDY_TEMPERATURE, SamplingParams
from tandem.runtime.value_checks import (ValidationError, finite_float32, fits_int64, is_int, is_number, key_name, short,
                                         type_name)

# Limits shared with the HTTP layer; SGLang uses the same ranges.
MAX_STOP_STRINGS = 32
MAX_N = 64


def params_from_request(d: Any, vocab_size: int, *, field: str = "sampling_params",
                        guided_decoding: bool = True) -> SamplingParams:
    """Validate a JSON `sampling_params` object (None means all defaults).

    `field` prefixes error messages, e.g. "sampling_params[2]" for one item of a batch.
    `guided_decoding` False (`--grammar-backend none`) makes every constraint a 400.
    """
    if d is None:
        return SamplingParams()
    if not isinstance(d, dict):
        raise ValidationError(field, f"must be an object, got {type_name(d)}")
    return _Checker(d, field, vocab_size, guided_decoding).build()


_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval", "max_thinking_tokens")
# `"max_new_tokens": null`, as in SGLang, is no limit of the client's: the request may fill the
# context (validation clamps it to the room the prompt leaves); absent, it is the default (128)
FILL_CONTEXT = 1 << 30
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
)
ANY_JSON = "$$ANY$$"  # SGLang's json_schema for "any JSON value" (xgrammar's built-in JSON grammar)
GUIDED_FIELDS = (*GRAMMAR_KINDS, "choice")  # SGLang's names; choice becomes a regex
_ALIASES = {"seed": "sampling_seed"}
# custom_params only reach a custom logit processor, which this server refuses: with none they
# cannot change the answer, so they are accepted and dropped (as SGLang does without a processor)
_DROPPED = frozenset({"custom_params"})
_KNOWN = set(SamplingParams.__struct_fields__) | set(_ALIASES) | {"choice"} | _DROPPED
_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")


class _Checker:
    """Reads one sampling_params dict field by field; JSON null means "use the default" (but for
    max_new_tokens: see FILL_CONTEXT)."""

    def __init__(self, d: dict, prefix: str, vocab_size: int, guided_decoding: bool) -> None:
        self.d = d
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.guided_decoding = guided_decoding
        self.out: dict[str, Any] = {}

    def fail(self, name: str, message: str) -> ValidationError:
        return ValidationError(f"{self.prefix}.{name}", message)

    def build(self) -> SamplingParams:
        for key in self.d:
            if key not in _KNOWN:
                raise self.fail(key_name(key), "is not a known sampling parameter")
        self._scalars()
        self._ranges()
        self._stop()
        self._logit_bias()
        self._seed()
        self._grammar()
        return SamplingParams(**self.out)

    def _present(self, name: str) -> bool:
        return self.d.get(name) is not None

    def _scalars(self) -> None:
        if "max_new_tokens" in self.d and self.d["max_new_tokens"] is None:
            self.out["max_new_tokens"] = FILL_CONTEXT
        for name in _INT_FIELDS:
            if self._present(name):
                v = self.d[name]
                if not is_int(v):
                    raise self.fail(name, f"must be an integer, got {type_name(v)}")
                if not fits_int64(v):  # msgpack on the IPC wire carries at most 64 bits
                    raise self.fail(name, f"must fit in a 64-bit integer, got {short(v)}")
                self.out[name] = v
        for name in _FLOAT_FIELDS:
            if self._present(name):
                v = self.d[name]
                if not is_number(v):
                    raise self.fail(name, f"must be a number, got {type_name(v)}")
                if finite_float32(v) is None:
                    raise self.fail(name, f"must be a finite float32, got {short(v)}")
                self.out[name] = float(v)
        for name in _BOOL_FIELDS:
            if self._present(name):
                v = self.d[name]
                if not isinstance(v, bool):
                    raise self.fail(name, f"must be a boolean, got {type_name(v)}")
                self.out[name] = v

    def _ranges(self) -> None:
        # defaults filled in; float ranges are checked on the float32 values the device will see
        p = SamplingParams(**self.out)
        f32 = {name: finite_float32(getattr(p, name)) for name in _FLOAT_FIELDS}
        for name in ("max_new_tokens", "min_new_tokens"):
            v = getattr(p, name)
            self._check(v >= 0, name, f"must be >= 0, got {v}")
        if p.max_thinking_tokens is not None:
            self._check(p.max_thinking_tokens >= 0, "max_thinking_tokens", f"must be >= 0, got {p.max_thinking_tokens}")
        self._check(
            p.min_new_tokens <= p.max_new_tokens,
            "min_new_tokens",
            f"must be <= max_new_tokens ({p.max_new_tokens}), got {p.min_new_tokens}",
        )
        self._check(f32["temperature"] >= 0, "temperature", f"must be >= 0, got {self._got('temperature', f32)}")
        self._check(0 < f32["top_p"] <= 1, "top_p", f"must be in (0, 1], got {self._got('top_p', f32)}")
        if f32["temperature"] < GREEDY_TEMPERATURE:  # SGLang: greedy is top_k 1, whatever top_k was given
            self.out["top_k"] = p.top_k if p.top_k >= 1 else -1
        else:
            self._check(p.top_k == -1 or p.top_k >= 1, "top_k", f"must be -1 (all) or >= 1, got {p.top_k}")
        self._check(0 <= f32["min_p"] <= 1, "min_p", f"must be in [0, 1], got {self._got('min_p', f32)}")
        for name in ("frequency_penalty", "presence_penalty"):
            self._check(-2 <= f32[name] <= 2, name, f"must be in [-2, 2], got {self._got(name, f32)}")
        rp = f32["repetition_penalty"]
        got = self._got("repetition_penalty", f32)
        self._check(0 < rp <= 2, "repetition_penalty", f"must be in (0, 2], got {got}")
        self._check(1 <= p.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {p.n}")
        si = p.stream_interval
        self._check(si is None or si >= 1, "stream_interval", f"must be >= 1, got {si}")
        if self.out.get("top_k", p.top_k) >= self.vocab_size:
            self.out["top_k"] = -1  # a k covering the whole vocabulary is "all"; saves a top-k pass

    def _got(self, name: str, f32: dict[str, float]) -> str:
        """The value as given, and what float32 makes of it when that differs (1e-300 -> 0)."""
        given, value = self.d.get(name), f32[name]
        if given is None or float(given) == value:
            return _num(value)
        return f"{short(given)} ({_num(value)} as a float32)"

    def _check(self, ok: bool, name: str, message: str) -> None:
        if not ok:
            raise self.fail(name, message)

    def _stop(self) -> None:
        if self._present("stop"):
            self.out["stop"] = self._stop_strings(self.d["stop"])
        if self._present("stop_regex"):
            self.out["stop_regex"] = self._stop_regexes(self.d["stop_regex"])
        if self._present("stop_token_ids"):
            ids = self.d["stop_token_ids"]
            if not isinstance(ids, list):
                got = type_name(ids)
                raise self.fail("stop_token_ids", f"must be a list of integers, got {got}")
            # SGLang's SamplingParams drops null entries (a client's unset optional ids) and keeps a
            # set: distinct ids, so a million repeats cannot make every step's stop check scan them
            self.out["stop_token_ids"] = list(dict.fromkeys(
                self._token_id(f"stop_token_ids[{i}]", t) for i, t in enumerate(ids) if t is not None))

    def _string_list(self, name: str, v: Any) -> list[str]:
        """A string or a list of at most MAX_STOP_STRINGS strings (SGLang takes a bare string as
        a one-element list)."""
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list):
            raise self.fail(name, f"must be a string or a list of strings, got {type_name(v)}")
        if len(items) > MAX_STOP_STRINGS:
            raise self.fail(name, f"has {len(items)} entries, at most {MAX_STOP_STRINGS} allowed")
        for i, s in enumerate(items):
            if not isinstance(s, str):
                raise self.fail(f"{name}[{i}]", f"must be a string, got {type_name(s)}")
        return list(items)

    def _stop_strings(self, stop: Any) -> list[str]:
        items = self._string_list("stop", stop)
        for i, s in enumerate(items):
            if not s:  # an empty stop string would match before the first token
                raise self.fail(_item("stop", i, stop), "must not be empty")
        return items

    def _stop_regexes(self, stop_regex: Any) -> list[str]:
        """SGLang's stop_regex: Python `re` syntax, compiled here so a bad pattern is a 400 naming
        it; also by the `regex` module the scheduler searches with, whose parser recurses deeper
        (200 nested groups passed `re` and killed the scheduler with a RecursionError)."""
        items = self._string_list("stop_regex", stop_regex)
        for i, pattern in enumerate(items):
            field = _item("stop_regex", i, stop_regex)
            try:
                matches_empty = re.compile(pattern).search("") is not None
                regex.compile(pattern)
            except (re.error, regex.error, RecursionError, OverflowError) as exc:
                raise self.fail(field, f"is not a valid regular expression: {exc}") from None
            if matches_empty:  # would stop before the first token, as an empty stop string would
                raise self.fail(field, "matches the empty string")
        return items

    def _token_id(self, name: str, t: Any) -> int:
        if not is_int(t):
            raise self.fail(name, f"must be an integer token id, got {type_name(t)}")
        if not 0 <= t < self.vocab_size:
            raise self.fail(name, f"must be in [0, {self.vocab_size}), got {short(t)}")
        return t

    def _logit_bias(self) -> None:
        if not self._present("logit_bias"):
            return
        bias = self.d["logit_bias"]
        if not isinstance(bias, dict):
            got = type_name(bias)
            raise self.fail("logit_bias", f"must be an object of token id -> bias, got {got}")
        out: dict[int, float] = {}
        for key, v in bias.items():
            name = f"logit_bias[{short(key, 30)}]"
            tid = self._token_id(name, _bias_key(key))
            if finite_float32(v) is None:
                raise self.fail(name, f"must be a finite float32 number, got {short(v)}")
            out[tid] = float(v)
        self.out["logit_bias"] = out or None

    def _seed(self) -> None:
        given = [k for k in ("sampling_seed", "seed") if self._present(k)]
        if len(given) == 2 and self.d["seed"] != self.d["sampling_seed"]:
            raise self.fail("seed", "conflicts with sampling_seed; give only one")
        if not given:
            return
        v = self.d[given[0]]
        if not is_int(v) or not fits_int64(v):
            raise self.fail(given[0], f"must be a 64-bit integer, got {short(v)}")
        self.out["sampling_seed"] = v

    def _grammar(self) -> None:
        given = [k for k in GUIDED_FIELDS if self._present(k)]
        if not given:
            return
        if not self.guided_decoding:
            raise self.fail(given[0], "needs guided decoding, which is off on this server (--grammar-backend none)")
        if len(given) > 1:
            raise self.fail(given[1], f"cannot be combined with {given[0]}; give one constraint")
        name, v = given[0], self.d[given[0]]
        if name == "choice":
            self.out["regex"] = self._choice_regex(v)
        elif name in ("json_schema", "structural_tag"):
            self.out[name] = self._json_text(name, v)
        else:
            if not isinstance(v, str):
                raise self.fail(name, f"must be a string, got {type_name(v)}")
            if not v:
                raise self.fail(name, "is an empty constraint")
            self.out[name] = v

    def _choice_regex(self, v: Any) -> str:
        """An alternation of the literal choices: every regex metacharacter escaped."""
        if not isinstance(v, list):
            raise self.fail("choice", f"must be a list of strings, got {type_name(v)}")
        if not v:
            raise self.fail("choice", "is an empty constraint")
        for i, c in enumerate(v):
            if not isinstance(c, str) or not c:
                raise self.fail(f"choice[{i}]", f"must be a non-empty string, got {short(c)}")
        escaped = ("".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in v)
        return "(?:" + "|".join(escaped) + ")"

    def _json_text(self, name: str, v: Any) -> str:
        """JSON schema / structural tag as JSON text, checked to parse (xgrammar checks the rest)."""
        if isinstance(v, dict):  # an inline object, for convenience
            try:
                v = orjson.dumps(v).decode()
            except orjson.JSONEncodeError as exc:
                raise self.fail(name, f"cannot be encoded as JSON: {exc}") from None
        if not isinstance(v, str):
            raise self.fail(name, f"must be a JSON string, got {type_name(v)}")
        if name == "json_schema" and v == ANY_JSON:
            return v
        if not v.strip():
            raise self.fail(name, "is an empty constraint")
        try:
            parsed = orjson.loads(v)
        except orjson.JSONDecodeError as exc:
            raise self.fail(name, f"is not valid JSON: {exc}") from None
        if not isinstance(parsed, dict) and not (name == "json_schema" and isinstance(parsed, bool)):
            raise self.fail(name, f"must be a JSON object, got {type_name(parsed)}")
        return v


_INT_KEY = re.compile(r"-?[0-9]{1,19}")


def _bias_key(key: Any) -> Any:
    """JSON object keys are strings: accept "123" (and ints from Python callers).

    The length cap keeps int() away from Python's huge-string guard (a ValueError).
    """
    if isinstance(key, str) and _INT_KEY.fullmatch(key.strip()):
        return int(key.strip())
    return key


def _item(name: str, i: int, given: Any) -> str:
    """Entry i of a string-or-list field, named as the client sent it: a bare string is the field."""
    return name if isinstance(given, str) else f"{name}[{i}]"


def _num(v: float) -> str:
    """Print 2.0 as 2 so messages read like the request ("got -1", not "got -1.0")."""
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)

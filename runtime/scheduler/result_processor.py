"""One result path for every step: new tokens per request are a list (length 1 without
speculation), appended with `extend`, and finish-checked with trimming (`finished_len`)."""
from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np
import regex

from tandem.ipc.messages import FinishReason, LogprobArrays
from tandem.runtime.scheduler.request import Req

_STOP_TAIL_TOKENS = 2  # extra tokens decoded around a stop string so one split across tokens is seen
_UNBOUNDED = 1 << 30  # a stop_regex window past any output: the whole output is searched
# One stop_regex search on the scheduler thread may take this long: a pattern that backtracks
# catastrophically ("(a+)+b" over a run of a's) would otherwise stall every request for hours.
STOP_REGEX_TIMEOUT_S = 0.05


class FinishChecker:
    def __init__(self, eos_ids: Sequence[int], decode: Callable[[list[int]], str]) -> None:
        self.eos_ids = set(eos_ids)
        self.decode = decode

    def finished_len(self, req: Req, new_tokens: list[int]) -> tuple[int, FinishReason | None]:
        """How many of `new_tokens` to keep, and why the request ends (None: it goes on).
        A constrained request's matcher accepts each kept token after the reasoning here, in
        order; such a request gets one token a step (it never drafts), so `in_reasoning` is
        current for it."""
        sp = req.sampling_params
        base = len(req.output_ids)
        for i, tok in enumerate(new_tokens):
            n_out = base + i + 1
            if n_out > sp.max_new_tokens:
                return i, FinishReason(type="length", length=sp.max_new_tokens)
            if n_out == sp.max_new_tokens:  # before stops, as in SGLang: the last allowed token ends by length
                return i + 1, FinishReason(type="length", length=sp.max_new_tokens)
            # as SGLang: ignore_eos switches off stop token ids too (the sampler bans them inside
            # min_new_tokens); stop strings count from the first token
            stoppable = n_out > sp.min_new_tokens and not sp.ignore_eos
            if stoppable and (tok in req.stop_ids or tok in self.eos_ids):
                return i + 1, FinishReason(type="stop", matched=tok)
            if sp.stop and (hit := self._stop_string(req, new_tokens[:i + 1])) is not None:
                return i + 1, FinishReason(type="stop", matched=hit)
            if sp.stop_regex:
                try:
                    hit = self._stop_regex(req, new_tokens[:i + 1])
                except TimeoutError:
                    return i, FinishReason.bad_request("sampling_params.stop_regex", "backtracks catastrophically: "
                                                       f"a search took over {STOP_REGEX_TIMEOUT_S:g} s")
                except (regex.error, RecursionError) as exc:  # validation compiled it on a shallower stack
                    return i, FinishReason.bad_request("sampling_params.stop_regex", f"does not compile: {exc}")
                if hit is not None:
                    return i + 1, FinishReason(type="stop", matched=hit)
            if req.grammar is not None and not req.in_reasoning:
                if not req.grammar.accept_token(tok):  # the mask allowed it, so this is a bug
                    return i, FinishReason(type="abort", status_code=500, err_type="InternalServerError",
                                           message=f"the grammar rejected sampled token {tok}")
                if req.grammar.is_terminated():  # the grammar is complete: the request ends
                    return i + 1, FinishReason(type="stop", matched=tok)
        return len(new_tokens), None

    def _stop_string(self, req: Req, new_tokens: list[int]) -> str | None:
        """The stop string in the output's tail, as SGLang: the first one ends the request, so one
        found here is the one the last token completed."""
        if not req.stop_window:  # once per request: a stop list may be megabytes
            # every token carries at least one byte of text: the stop's UTF-8 length in tokens covers
            # it (an emoji is one character but up to four byte-level tokens)
            req.stop_window = max(len(s.encode()) for s in req.sampling_params.stop) + _STOP_TAIL_TOKENS
        tail = self.decode(tail_ids(req.output_ids, new_tokens, req.stop_window))
        return next((stop for stop in req.sampling_params.stop if stop in tail), None)


    def _stop_regex(self, req: Req, new_tokens: list[int]) -> str | None:
        """The first stop_regex found in the output's tail (a search, as SGLang's `re.search`); `matched` is
        the pattern, as SGLang reports it. The tail covers the longest text a pattern can match
        (the whole output for an unbounded one such as `\\d+`, as in SGLang)."""
        if not req.stop_regex_window:
            req.stop_regex_window = max(map(regex_token_bound, req.sampling_params.stop_regex)) + _STOP_TAIL_TOKENS
        tail = self.decode(tail_ids(req.output_ids, new_tokens, req.stop_regex_window))
        # the `regex` module: `re`'s syntax with a timeout (TimeoutError)
        return next((p for p in req.sampling_params.stop_regex
                     if regex.search(p, tail, timeout=STOP_REGEX_TIMEOUT_S)), None)


def tail_ids(output_ids: list[int], new_tokens: list[int], window: int) -> list[int]:
    """`(output_ids + new_tokens)[-window:]`, copying only the tail (never the whole output, at
    every token of every request with a stop)."""
    keep = window - len(new_tokens)
    return (output_ids[-keep:] if keep > 0 else []) + new_tokens[-window:]


def regex_token_bound(pattern: str) -> int:
    """Most output tokens a match of `pattern` can span: every token carries at least one byte
    and a character at most four. Unbounded (or unknown to `re`'s parser): _UNBOUNDED."""
    try:
        most_chars = re._parser.parse(pattern).getwidth()[1]  # type: ignore[attr-defined]
    except Exception:  # the private parser moved or changed: scan the whole output
        return _UNBOUNDED
    return _UNBOUNDED if most_chars >= _UNBOUNDED else 4 * most_chars


def apply_new_tokens(req: Req, new_tokens: list[int], logprobs: list[LogprobArrays] | None,
                     hidden: list[np.ndarray] | None, checker: FinishChecker) -> bool:
    """Append the request's accepted tokens with their logprobs and hidden rows (one each per
    kept token); True when it finished."""
    keep, reason = checker.finished_len(req, new_tokens)
    if req.sampling_params.max_new_tokens == 0:
        # prefill-only: no token is kept, but the first output position's logprob and hidden
        # row are (SGLang does the same)
        keep_extras = 1
    else:
        req.output_ids.extend(new_tokens[:keep])
        keep_extras = keep
        if req.think is not None:
            for token in new_tokens[:keep]:
                req.think.feed(token)
    if logprobs:
        req.output_logprobs.extend(logprobs[:keep_extras])
    if hidden:
        req.hidden_states.extend(hidden[:keep_extras])
    if reason is not None:
        req.finished_reason = reason
    return reason is not None


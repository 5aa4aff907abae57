"""Builds one BatchTokenIDOutput per step from the requests that have news.

Per request, cursors for tokens, output logprob blocks and hidden-state blocks move together:
every token sent carries exactly one output logprob (and one hidden row when asked), across
retraction and for prefill-only requests.
"""
from __future__ import annotations

import numpy as np

from tandem.ipc.messages import BatchTokenIDOutput, DetokenizeParams, ReqCounters, SpecCounts
from tandem.runtime.envs import envs
from tandem.runtime.sampling.logprob_format import concat_parts
from tandem.runtime.scheduler.request import Req


class OutputStreamer:
    def __init__(self, default_stream_interval: int, drafts_per_verify: int = 0) -> None:
        self.default_stream_interval = default_stream_interval
        # a speculating server (> 0): every output carries its request's spec counts, 0 verifies too;
        # drafts proposed are verifies x this, as SGLang counts them (whatever the lookup found)
        self.drafts_per_verify = drafts_per_verify
        self.force_stream_interval = envs.FORCE_STREAM_INTERVAL.get()
        self._pending: dict[int, Req] = {}

    def add(self, req: Req) -> None:
        """Consider the request for this step's output (it got tokens, finished or was aborted)."""
        self._pending[id(req)] = req

    def should_send(self, req: Req) -> bool:
        if req.finished:
            return True
        new = len(req.output_ids) - req.cursor.tokens
        if new <= 0:
            return False
        if req.stream:  # the first token at once, then every interval-th (SGLang's 1, 1 + k, 1 + 2k, ...)
            return req.cursor.tokens == 0 or new >= (req.sampling_params.stream_interval
                                                      or self.default_stream_interval)
        # non-streaming logprob / hidden-state requests still ship in pieces so nothing is rebuilt at the end
        return (req.return_logprob or req.return_hidden_states) and new >= self.force_stream_interval

    def build(self) -> BatchTokenIDOutput | None:
        reqs = [r for r in self._pending.values() if self.should_send(r)]
        self._pending.clear()
        if not reqs:
            return None
        out = BatchTokenIDOutput(rids=[], finished_reasons=[], new_token_ids=[], counters=[], detokenize_params=[])
        any_lp = any(r.return_logprob for r in reqs)
        any_hidden = any(r.return_hidden_states for r in reqs)
        for r in reqs:
            self._append(out, r)
            out.counters.append(self._counters(r))
            if any_lp:
                self._append_logprobs(out, r)
            if any_hidden:
                self._append_hidden(out, r)
        return out

    @staticmethod
    def _append(out: BatchTokenIDOutput, r: Req) -> None:
        out.rids.append(r.rid)
        out.finished_reasons.append(r.finished_reason)
        out.new_token_ids.append(np.asarray(r.output_ids[r.cursor.tokens:], dtype=np.int32))
        # per-request constants travel once: a 48 MB stop list must not ride every step
        out.detokenize_params.append(None if r.cursor.sent_any else _detokenize_params(r))
        r.cursor.sent_any = True
        r.cursor.tokens = len(r.output_ids)

    def _counters(self, r: Req) -> ReqCounters:
        spec = None
        if self.drafts_per_verify:  # every request of a speculating server, verified yet or not
            spec = SpecCounts(verify_ct=r.spec.verify_ct, proposed=r.spec.verify_ct * self.drafts_per_verify,
                              accepted=r.spec.accepted_drafts, accept_histogram=list(r.spec.accept_histogram))
        return ReqCounters(completion_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
                           retractions=r.retract_count, reasoning_tokens=r.reasoning_tokens, spec=spec)

    @staticmethod
    def _append_logprobs(out: BatchTokenIDOutput, r: Req) -> None:
        outputs = inputs = None
        if r.return_logprob:
            if r.cursor.logprobs < len(r.output_logprobs):
                outputs = concat_parts(r.output_logprobs[r.cursor.logprobs:])
                r.cursor.logprobs = len(r.output_logprobs)
            if r.input_logprobs is not None and r.input_logprobs.done and not r.cursor.input_logprobs:
                inputs = r.input_logprobs.finalize()
                r.cursor.input_logprobs = True
        out.output_logprobs.append(outputs)
        out.input_logprobs.append(inputs)

    @staticmethod
    def _append_hidden(out: BatchTokenIDOutput, r: Req) -> None:
        rows = None
        if r.return_hidden_states and r.cursor.hidden < len(r.hidden_states):
            rows = np.concatenate(r.hidden_states[r.cursor.hidden:])
            r.cursor.hidden = len(r.hidden_states)
        out.hidden_states.append(rows)


# prompt tokens decoded before the first output token (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET)
PROMPT_TAIL = 5


def _detokenize_params(r: Req) -> DetokenizeParams:
    sp = r.sampling_params
    return DetokenizeParams(skip_special_tokens=sp.skip_special_tokens,
                            spaces_between_special_tokens=sp.spaces_between_special_tokens,
                            no_stop_trim=sp.no_stop_trim, stop_strings=tuple(sp.stop),
                            prompt_tail=tuple(int(t) for t in r.origin_input_ids[-PROMPT_TAIL:]))

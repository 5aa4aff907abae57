"""PrefillAdder: admission for one prefill step under a token budget and a KV reserve.

The budget is the new tokens one prefill step may compute: `--chunked-prefill-size` (as in
SGLang, a cap on the whole step, not on each prompt), and never more than
`--max-prefill-tokens`. A prompt longer than what is left of the budget is split, and the
request whose prompt is split becomes the ChunkedReq that continues first in the next prefill
step. A request is admitted only when its whole remaining prompt fits, not just the chunk this
step computes, so a split prompt's later chunks do not take the memory running requests decode
into. The reserve is KV memory held back for the decode of running and admitted requests (a
share of their remaining max_new_tokens), so that admitting one more prompt does not force a
retraction right away; it only counts when some other request competes for the memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.runtime.scheduler.batch import ExtendSpan
from tandem.runtime.scheduler.kv_manager import KVManager
from tandem.runtime.scheduler.request import Req

NEW_TOKEN_RATIO = 0.3  # share of a request's remaining max_new_tokens held back for its decode
_MAX_RESERVE_PER_REQ = 4096


def decode_reserve(reqs: list[Req]) -> int:
    return int(sum(min(r.sampling_params.max_new_tokens - len(r.output_ids), _MAX_RESERVE_PER_REQ)
                   for r in reqs) * NEW_TOKEN_RATIO)


@dataclass
class ChunkedReq:
    """The request whose prompt is being prefilled over several steps; it does not decode (or
    sample) until its last chunk has run, and nothing new is admitted behind it meanwhile."""

    req: Req

    @property
    def remaining(self) -> int:
        return self.req.seq_len - self.req.kv.alloc_len


class PrefillAdder:
    def __init__(self, kv: KVManager, token_budget: int, running: list[Req]) -> None:
        self.kv = kv
        self.budget = token_budget
        self.reserve = decode_reserve(running)
        self.competing = bool(running)
        self.spans: list[ExtendSpan] = []
        self.admitted: list[Req] = []  # new requests (not the continuing chunked one)
        self.chunked: ChunkedReq | None = None  # the request left unfinished by this step

    @property
    def closed(self) -> bool:
        """No more requests fit this step: out of budget, or a prompt was split."""
        return self.budget <= 0 or self.chunked is not None

    def continue_chunked(self, chunked: ChunkedReq) -> bool:
        """The next chunk of a split prompt; False when memory is full (decode steps free it)."""
        return self._extend(chunked.req, min(chunked.remaining, self.budget))

    def shortfall(self, req: Req, prefix_len: int) -> int:
        """KV slots `req` lacks to be admitted now with `prefix_len` of it cached (<= 0: it fits):
        its prompt past the prefix, plus the decode reserve of everything running and of `req`
        once other requests compete for the pool."""
        held_back = self.reserve + decode_reserve([req]) if (self.competing or self.spans) else 0
        return req.seq_len - prefix_len + held_back - self.kv.available_tokens()

    def add(self, req: Req) -> bool:
        """Admit a waiting request (with its cached prefix); False: it does not fit, stop admitting."""
        prefix_slots, node = self.kv.match_prefix(req)
        if not self.kv.start(req, prefix_slots, node):
            return False
        short = self.shortfall(req, req.kv.alloc_len)
        self.reserve += decode_reserve([req])
        prompt_left = req.seq_len - req.kv.alloc_len
        if short > 0 or not self._extend(req, min(prompt_left, self.budget)):
            self.kv.release(req)
            return False
        if req.retract_count == 0:
            req.cached_tokens = len(prefix_slots)
        self.admitted.append(req)
        return True

    def _extend(self, req: Req, n: int) -> bool:
        prefix = req.kv.alloc_len
        if self.kv.extend(req, n) is None:
            return False
        self.kv.cache_prefill(req)
        # read the slots back: where caching found the same tokens already in the tree (an n>1
        # sibling admitted just before), the row now points at the tree's slots and ours were
        # freed, so this step must write there and not into a slot that may be handed out again
        slots = self.kv.row_slots(req, prefix, prefix + n)
        done = req.kv.alloc_len >= req.seq_len
        self.chunked = None if done else ChunkedReq(req)
        self.spans.append(ExtendSpan(req, prefix, n, slots, samples=done))
        self.budget -= n
        return True

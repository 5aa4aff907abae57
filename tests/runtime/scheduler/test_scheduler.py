"""The scheduler's cache flush and its prefill log line, driven through its methods on the
process-free core (tests/scheduler_core.py): no model, no sockets; replies and log numbers are
collected instead of sent."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
from scheduler_core import Core, make_core

from tandem.ipc.messages import FlushCacheReply, FlushCacheReq, TokenizedGenerateReq
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.scheduler.grammar_queue import GrammarQueue
from tandem.runtime.scheduler.request import Req
from tandem.runtime.scheduler.scheduler import Scheduler


class _SlowCompiler:
    """A grammar backend whose compiles never finish (a large schema compiling for seconds)."""

    def compile(self, kind: str, text: str) -> Future:
        return Future()

    def release(self, kind: str, text: str) -> None:
        pass


class _PrefillLog:
    """Records the numbers of each `Prefill batch.` log line."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, int, int]] = []

    def log_prefill(self, new_seqs: int, new_tokens: int, cached_tokens: int, *_: object) -> None:
        self.lines.append((new_seqs, new_tokens, cached_tokens))


def _scheduler(core: Core, replies: list) -> Scheduler:
    sched = object.__new__(Scheduler)
    sched.planner, sched.kv, sched.rows = core.planner, core.kv, core.rows
    sched.runner = SimpleNamespace(max_total_tokens=core.kv.allocator.size)
    sched.stats = _PrefillLog()
    sched.grammar_queue = GrammarQueue(_SlowCompiler(), timeout_s=60.0)  # type: ignore[arg-type]
    sched._flush_pending = []
    sched._reply = replies.append  # type: ignore[method-assign]
    return sched


def _constrained_req(rid: str) -> Req:
    sp = SamplingParams(max_new_tokens=4, json_schema='{"type": "object"}')
    msg = TokenizedGenerateReq(rid=rid, input_ids=np.arange(10, 20, dtype=np.int32), sampling_params=sp,
                               stream=False)
    return Req.from_message(msg, 1, default_seed=1)


def test_flush_cache_refused_while_a_grammar_compiles() -> None:
    """SGLang's flush_cache needs is_fully_idle, whose queues include the grammar queue: a request
    still compiling its grammar is pending, and the flush is refused with the queue counts."""
    core, replies = make_core(), []
    sched = _scheduler(core, replies)
    core.add("warm_0", list(range(30, 40)), max_new_tokens=2)
    core.run()
    cached = core.kv.tree.total_size()
    assert cached > 0
    sched.grammar_queue.add(_constrained_req("g_0"))  # type: ignore[union-attr]
    sched._handle(FlushCacheReq(req_id=7))
    sched._flush_cache()
    assert replies == [FlushCacheReply(req_id=7, success=False,
                                       message="there are pending requests. #queue-req: 1, #running-req: 0")]
    assert core.kv.tree.total_size() == cached  # nothing was dropped
    sched.grammar_queue.take([], abort_all=True)  # type: ignore[union-attr]
    sched._handle(FlushCacheReq(req_id=8))
    sched._flush_cache()
    assert replies[-1] == FlushCacheReply(req_id=8, success=True, message="")
    assert core.kv.tree.total_size() == 0
    assert core.kv.allocator.available_size() == core.kv.allocator.size


def test_prefill_log_counts_cache_hits_not_earlier_chunks() -> None:
    """`#cached-token` is what SGLang's PrefillAdder logs: the prefix-cache hits of the requests the
    step admits. A split prompt's later chunks start after its own earlier chunks, which add_chunked_req
    counts as 0 hits; a cold 20-token prompt in chunks of 8 logs no hit at all."""
    core = make_core(chunked_prefill_size=8)
    sched = _scheduler(core, [])
    prompt = list(range(40, 60))
    for rid in ("cold_0", "warm_0"):
        core.add(rid, prompt, max_new_tokens=1)
        while core.planner.waiting or core.planner.chunked is not None:
            continued = core.planner.chunked
            batch = core.plan()
            sched._log(batch, continued.req if continued is not None else None)
            core.process(batch)
    assert sched.stats.lines == [(1, 8, 0), (1, 8, 0), (1, 4, 0), (1, 1, 19)]

"""SchedulerCore's control side: the cache flush and the numbers of the prefill log line, driven
with the fake worker (fake_worker.py): no model, no sockets."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
from tests.runtime.scheduler.fake_worker import make_core

from tandem.ipc.messages import TokenizedGenerateReq
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.scheduler.grammar_queue import GrammarQueue
from tandem.runtime.scheduler.request import Phase


class _SlowCompiler:
    """A grammar backend whose compiles never finish (a large schema compiling for seconds)."""

    def compile(self, kind: str, text: str) -> Future:
        return Future()

    def release(self, kind: str, text: str) -> None:
        pass


def _constrained_msg(rid: str) -> TokenizedGenerateReq:
    sp = SamplingParams(max_new_tokens=4, json_schema='{"type": "object"}')
    return TokenizedGenerateReq(rid=rid, input_ids=np.arange(10, 20, dtype=np.int32), sampling_params=sp,
                                stream=False)


def test_flush_cache_refused_while_a_grammar_compiles() -> None:
    """SGLang's flush_cache needs is_fully_idle, whose queues include the grammar queue: a request
    still compiling its grammar is pending, and the flush is refused with the queue counts."""
    harness = make_core()
    core = harness.core
    core.grammar_queue = GrammarQueue(_SlowCompiler(), timeout_s=60.0)  # type: ignore[arg-type]
    harness.add("warm_0", list(range(30, 40)), max_new_tokens=2)
    harness.run()
    cached = core.kv.tree.total_size()
    assert cached > 0
    assert core.add(_constrained_msg("g_0")).phase is Phase.COMPILING
    assert core.flush_cache() == "there are pending requests. #queue-req: 1, #running-req: 0"
    assert core.kv.tree.total_size() == cached  # nothing was dropped
    assert [r.rid for r in core.abort([], abort_all=True)] == ["g_0"]
    assert core.flush_cache() is None
    assert core.kv.tree.total_size() == 0
    assert core.kv.allocator.available_size() == core.kv.allocator.size


def test_constrained_request_refused_without_a_grammar_backend() -> None:
    """--grammar-backend none: a constrained request ends at once with a 400 naming its field."""
    core = make_core().core
    req = core.add(_constrained_msg("g_0"))
    assert req.phase is Phase.DONE and req.finished_reason.status_code == 400
    assert req.finished_reason.field == "sampling_params.json_schema"
    out = core.flush()
    assert out is not None and out.rids == ["g_0"] and out.finished_reasons == [req.finished_reason]


def test_prefill_log_counts_cache_hits_not_earlier_chunks() -> None:
    """`#cached-token` is what SGLang's PrefillAdder logs: the prefix-cache hits of the requests the
    step admits. A split prompt's later chunks start after its own earlier chunks, which add_chunked_req
    counts as 0 hits; a cold 20-token prompt in chunks of 8 logs no hit at all."""
    core = make_core(chunked_prefill_size=8)
    prompt = list(range(40, 60))
    lines = []
    for rid in ("cold_0", "warm_0"):
        core.add(rid, prompt, max_new_tokens=1)
        while core.planner.waiting or core.planner.chunked is not None:
            continued = core.planner.chunked
            batch = core.plan()
            lines.append((len(batch.spans), batch.num_tokens, batch.cache_hits(continued.req if continued else None)))
            core.process(batch)
    assert lines == [(1, 8, 0), (1, 8, 0), (1, 4, 0), (1, 1, 19)]

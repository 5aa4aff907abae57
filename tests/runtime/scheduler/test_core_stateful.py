"""Stateful property test of SchedulerCore (driven by the fake worker of fake_worker.py).

Hypothesis drives the core, its planner, KV manager and request rows through random interleavings of
arrivals (n>1 sibling groups, shared prompt prefixes, priorities, stop tokens, min_new_tokens),
loop iterations (overlap on: plan N+1 before processing N; off: plan then process), group
aborts and abort-all, memory held by something else (so that retraction, requeueing of the
chunked prompt and out-of-memory really happen on small pools), and cache flushes when idle.

Besides the bookkeeping invariants (every KV slot owned exactly once, radix lock refs, rows,
queues) it keeps a shadow of what each KV slot holds: the fake model's KV at position i of a
sequence is identified by the tokens [0, i], and since the fake model samples 1000 + position,
the tokens of every request are known in advance. A step "runs" when the harness processes it
(steps run in launch order): it writes its spans' slots, then every span must read, at every
earlier position, a slot holding that request's content (through its row as it was at launch
and as it is when the step runs). With nothing in flight, every tree node's slots hold the
content of its path. So a slot handed out while still needed, a tree node pointing at foreign
slots, or a row that reads the wrong prefix fails here, which output tokens alone never show.
"""
from __future__ import annotations

import time

import torch
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tests.runtime.scheduler.fake_worker import CONTEXT, Harness, fake_token, make_core

from tandem.runtime.cache.pools import DECODE_SLOT_RUN
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.scheduler.batch import ScheduleBatch
from tandem.runtime.scheduler.request import Phase, Req

# three "system prompts"; a prompt is a cut of one plus a short suffix, so prefixes are shared
FAMILIES = [list(range(100, 116)), list(range(200, 216)), [300 + (i % 3) for i in range(16)]]
MAX_DRAIN_ITERATIONS = 3000


def content_chain(tokens: list[int], extra_key: str | None, start: int | None = None) -> list[int]:
    """KV identity per position: position i holds the KV of the causal prefix tokens[:i + 1] under
    `extra_key` (a LoRA adapter or cache salt computes other KV for the same tokens)."""
    out, h = [], hash(("extra_key", extra_key)) if start is None else start
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class Expect:
    """What the fake model makes of one request: its whole token sequence and where it ends."""

    def __init__(self, prompt: list[int], max_new: int, stop_at: int | None, min_new: int,
                 extra_key: str | None) -> None:
        p = len(prompt)
        self.tokens = prompt + [fake_token(p + k) for k in range(max_new)]
        self.content = content_chain(self.tokens, extra_key)
        self.outputs = self.tokens[p:]
        if stop_at is not None and stop_at + 1 < max_new and stop_at + 1 > min_new:
            self.length, self.reason = stop_at + 1, "stop"
        else:
            self.length, self.reason = max_new, "length"


prompts = st.builds(lambda fam, cut, suffix: (FAMILIES[fam][:cut] + suffix) or [7],
                    st.integers(0, len(FAMILIES) - 1), st.integers(0, 16),
                    st.lists(st.integers(10, 13), max_size=5))


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core: Harness | None = None
        self.in_flight: ScheduleBatch | None = None
        self.launch_rows: dict[int, list[torch.Tensor]] = {}  # step id -> each span's row prefix at launch
        self.kv_content: dict[int, int] = {}  # slot -> content id written by the last step that ran
        self.reqs: list[Req] = []
        self.expect: dict[str, Expect] = {}
        self.groups: list[str] = []
        self.hog: torch.Tensor | None = None  # KV slots held by something else
        self.ooms = 0

    # -- setup -----------------------------------------------------------------------------------------
    @initialize(max_total=st.integers(16, 64), max_running=st.integers(1, 4), radix=st.booleans() | st.just(True),
                chunk=st.sampled_from([-1, 3, 5, 8, 2048]), prefill=st.sampled_from([6, 12, 8192]),
                retract_every=st.sampled_from([0, 0, 2, 3]), priority=st.booleans(), preempt=st.booleans(),
                policy=st.sampled_from(["fcfs", "lpm"]), overlap=st.booleans())
    def setup(self, max_total, max_running, radix, chunk, prefill, retract_every, priority, preempt, policy, overlap):
        note(f"make_core(max_total_tokens={max_total}, max_running_requests={max_running}, radix={radix}, "
             f"chunked_prefill_size={chunk}, max_prefill_tokens={prefill}, force_retract_every={retract_every}, "
             f"enable_priority_scheduling={priority}, priority_preemption={preempt}, schedule_policy={policy!r}); "
             f"overlap={overlap}")
        self.core = make_core(max_total_tokens=max_total, max_running_requests=max_running, radix=radix,
                              chunked_prefill_size=chunk, max_prefill_tokens=prefill,
                              force_retract_every=retract_every, enable_priority_scheduling=priority,
                              priority_preemption=preempt, schedule_policy=policy, request_timeout=1e9)
        self.overlap = overlap
        self.max_total = max_total

    # -- rules -------------------------------------------------------------------------------------------
    @rule(prompt=prompts, n=st.integers(1, 3), max_new=st.integers(0, 24),
          priority=st.sampled_from([None, 0, 3, 15, -5]),
          stop=st.none() | st.tuples(st.integers(0, 23), st.integers(0, 3)),
          extra_key=st.sampled_from([None, None, None, "salt"]))
    def add_group(self, prompt, n, max_new, priority, stop, extra_key):
        cap = min(self.max_total, CONTEXT)
        prompt = prompt[:cap - 1]
        max_new = min(max_new, cap - len(prompt))
        group = f"g{len(self.groups):03d}_"
        self.groups.append(group)
        sp: dict = {}
        stop_at = min_new = None
        if stop is not None:
            stop_at, min_new = stop
            sp = dict(ignore_eos=False, stop_token_ids=[fake_token(len(prompt) + stop_at)], min_new_tokens=min_new)
        expect = Expect(prompt, max_new, stop_at, min_new or 0, extra_key)
        for i in range(n):
            req = self.core.add(f"{group}{i}", list(prompt), max_new_tokens=max_new, priority=priority,
                                extra_key=extra_key, **sp)
            self.reqs.append(req)
            self.expect[req.rid] = expect

    @rule(iterations=st.integers(1, 6))
    def step(self, iterations):
        for _ in range(iterations):
            self._iteration()

    @rule(iterations=st.integers(1, 6))
    def more_steps(self, iterations):  # a second rule: stepping is drawn twice as often as anything else
        self.step(iterations)

    @rule(pick=st.integers(0, 1 << 16), everything=st.sampled_from([False] * 5 + [True]))
    @precondition(lambda self: self.groups)
    def abort(self, pick, everything):
        """An AbortReq between loop iterations (a step may be in flight): one group, or all."""
        if everything:
            self.core.abort(abort_all=True)
        else:
            self.core.abort(self.groups[pick % len(self.groups)])

    @rule(pick=st.integers(0, 1 << 16))
    def time_out_a_queued_request(self, pick):
        """--request-timeout: the scheduler finishes a waiting request that was never admitted."""
        expired = self.core.core.expired_rids(time.monotonic() + 2e9)
        if not expired:
            return
        rid = expired[pick % len(expired)]
        req = next(r for r in self.core.planner.waiting if r.rid == rid)
        assert not req.output_ids and req.outputs_in_flight == 0, f"{req.rid} ran, yet it times out as never admitted"
        self.core.expire([rid])
        assert req.finished_reason.status_code == 503

    @rule(fraction=st.floats(0.3, 1.0))
    @precondition(lambda self: self.hog is None)
    def hold_memory(self, fraction):
        """Something else takes a share of the obtainable slots (evicting cached ones): the planner
        must cope, by retracting or, for a request alone in memory, by giving it up."""
        self.hog = self.core.kv.alloc_slots(int(self.core.kv.available_tokens() * fraction))

    @rule()
    @precondition(lambda self: self.hog is not None)
    def give_memory_back(self):
        self.core.kv.allocator.free(self.hog)
        self.hog = None

    @rule()
    @precondition(lambda self: self.in_flight is None and self.hog is None and not self.core.planner.has_work())
    def flush_cache(self):
        self.core.kv.flush()

    # -- the loop ----------------------------------------------------------------------------------------
    def _iteration(self) -> None:
        """One pass of Scheduler.event_loop: plan (and launch) N+1, process N; without overlap,
        process N+1 at once."""
        core = self.core
        finished_before = len(core.finished)
        batch = core.plan()
        for req in core.finished[finished_before:]:
            if req.finished_reason.err_type == "OutOfMemory":
                self.ooms += 1
                # a request alone in KV memory always fits (admission checks max_total_len), so
                # only memory held by something else may leave it out of memory
                assert self.hog is not None, f"{req.rid} aborted out of memory with no memory held elsewhere"
        if batch is not None:
            self._on_launch(batch)
        elif self.in_flight is None and core.planner.has_work() and self.hog is None:
            raise AssertionError("work is queued, nothing is in flight, yet no step was planned (stuck)")
        if self.in_flight is not None:
            self._process(self.in_flight)
        self.in_flight = batch
        if not self.overlap and batch is not None:
            self._process(batch)
            self.in_flight = None

    def _on_launch(self, batch: ScheduleBatch) -> None:
        assert batch.mode in (ForwardMode.EXTEND, ForwardMode.DECODE)
        free = self._free_slots()
        rows = []
        for span in batch.spans:
            written = set(span.out_cache_loc.tolist())
            assert not written & free, f"{span.req.rid}: a step writes a free KV slot"
            assert 0 not in written
            rows.append(self.core.kv.req_to_token[span.req.kv.req_pool_idx, :span.prefix_len].clone())
        self.launch_rows[batch.step_id] = rows

    def _process(self, batch: ScheduleBatch) -> None:
        """The step runs (in launch order): write its KV, check what it reads, then apply results."""
        written: dict[int, tuple[int, str]] = {}
        for span in batch.spans:
            content = self.expect[span.req.rid].content
            for j, slot in enumerate(span.out_cache_loc.tolist()):
                c = content[span.prefix_len + j]
                if slot in written and written[slot][0] != c:
                    raise AssertionError(f"step {batch.step_id}: slot {slot} written with different KV by "
                                         f"{written[slot][1]} and {span.req.rid}")
                written[slot] = (c, span.req.rid)
        for slot, (c, _) in written.items():
            self.kv_content[slot] = c
        at_launch = self.launch_rows.pop(batch.step_id)
        rows_now = batch.job.rows
        for span, row_then, row in zip(batch.spans, at_launch, rows_now):
            content = self.expect[span.req.rid].content
            views = [row_then]
            if span.req.kv.req_pool_idx == row:  # still alive: the worker may read the row as it is now
                views.append(self.core.kv.req_to_token[row, :span.prefix_len])
            for view in views:
                for i, slot in enumerate(view.tolist()):
                    assert self.kv_content.get(slot) == content[i], (
                        f"step {batch.step_id}: {span.req.rid} reads position {i} from slot {slot}, "
                        f"which holds other KV")
        if batch.mode == ForwardMode.DECODE:  # the input token relayed through the future map
            bonus = self.core.future_map.bonus[torch.tensor(rows_now)].tolist()
            for span, tok in zip(batch.spans, bonus):
                assert tok == self.expect[span.req.rid].tokens[span.prefix_len], (span.req.rid, span.prefix_len, tok)
        self.core.process(batch)

    # -- invariants --------------------------------------------------------------------------------------
    def _free_slots(self) -> set[int]:
        alloc = self.core.kv.allocator
        free = alloc._free.tolist() + [s for p in alloc._pending for s in p.tolist()]
        assert len(set(free)) == len(free), "a slot is twice in the free list"
        return set(free)

    def _tree_nodes(self):
        """(node, content ids of its slots) for every node, root first."""
        tree = self.core.kv.tree
        stack = [(tree.root, None)]
        while stack:
            node, h = stack.pop()
            chain = []
            if node is not tree.root:
                chain = content_chain(node.key, node.extra_key, start=h)
            yield node, chain
            for key, child in node.children.items():
                assert child.parent is node and len(child.key) > 0 and key == (child.extra_key, child.key[0])
                assert len(child.value) == len(child.key)
                assert node is tree.root or child.extra_key == node.extra_key
                stack.append((child, chain[-1] if chain else None))

    def _live(self) -> list[Req]:
        planner = self.core.planner
        return planner.running + ([planner.chunked.req] if planner.chunked is not None else [])

    @invariant()
    def queues_are_disjoint_and_complete(self):
        if self.core is None:
            return
        planner = self.core.planner
        live, waiting, finished = self._live(), planner.waiting, self.core.finished
        places = [id(r) for r in live + waiting + finished]
        assert len(places) == len(set(places)), "a request is in two places (queues / finished)"
        assert len(places) == len(self.reqs), "a request went missing"
        assert planner.num_running <= planner.cfg.max_running_requests
        chunked = [planner.chunked.req] if planner.chunked is not None else []
        for phase, reqs in ((Phase.RUNNING, planner.running), (Phase.CHUNKED, chunked), (Phase.WAITING, waiting),
                            (Phase.DONE, finished)):
            assert all(r.phase is phase for r in reqs), [(r.rid, r.phase) for r in reqs if r.phase is not phase]
        for r in waiting + finished:
            assert r.kv.req_pool_idx is None and r.kv.alloc_len == 0 and r.kv.last_node is None, r.rid
        for r in live:
            assert r.kv.req_pool_idx is not None and r.kv.last_node is not None and not r.finished, r.rid
        for r in waiting:
            assert not r.finished, r.rid
        if planner.chunked is not None:
            c = planner.chunked.req
            assert c.kv.alloc_len < c.seq_len and c.outputs_in_flight == 0
        for r in planner.running:
            # decode slots are reserved in runs: at most a run ahead, never past the last position
            # the request can compute
            state = (r.rid, r.kv.committed_len, r.kv.alloc_len, r.seq_len, r.outputs_in_flight)
            assert r.kv.committed_len == r.seq_len - 1 + r.outputs_in_flight, state
            assert r.kv.committed_len <= r.kv.alloc_len < r.kv.committed_len + DECODE_SLOT_RUN, state
            assert r.kv.alloc_len == r.kv.committed_len or r.kv.alloc_len <= r.max_total_len() - 1, state

    @invariant()
    def outputs_follow_the_fake_model(self):
        if self.core is None:
            return
        nothing_in_flight = self.in_flight is None
        for r in self.reqs:
            exp = self.expect[r.rid]
            assert r.output_ids == exp.outputs[:len(r.output_ids)], (r.rid, r.output_ids, exp.outputs)
            assert r.outputs_in_flight >= 0 and (r.outputs_in_flight == 0 or not nothing_in_flight), r.rid
            assert len(r.output_ids) + r.outputs_in_flight <= max(r.sampling_params.max_new_tokens, 1)
            reason = r.finished_reason
            if reason is None:
                assert len(r.output_ids) < max(exp.length, 1), (r.rid, "should have finished")
            elif reason.type == "abort":
                assert len(r.output_ids) <= exp.length
            else:
                assert (reason.type, len(r.output_ids)) == (exp.reason, exp.length), (r.rid, reason, r.output_ids)

    @invariant()
    def every_slot_is_owned_once_and_locks_match(self):
        if self.core is None:
            return
        kv, tree = self.core.kv, self.core.kv.tree
        size = kv.allocator.size
        free = self._free_slots()
        assert not kv.allocator._is_free[0]
        assert set(torch.nonzero(kv.allocator._is_free).flatten().tolist()) == free
        owners: dict[int, str] = {s: "free" for s in free}

        def own(slots: list[int], who: str) -> None:
            for s in slots:
                assert 1 <= s <= size, (who, s)
                assert s not in owners, f"slot {s} owned by both {owners[s]} and {who}"
                owners[s] = who

        locks: dict[int, int] = {}
        evictable = protected = 0
        nodes = {}
        for node, _ in self._tree_nodes():
            nodes[id(node)] = node
            if node is not tree.root:
                own(node.value.tolist(), "tree")
                if node.lock_ref == 0:
                    evictable += len(node.key)
                else:
                    protected += len(node.key)
        assert tree.root.lock_ref == 1
        assert (tree.evictable_size(), tree.protected_size()) == (evictable, protected)
        for r in self._live():
            node = r.kv.last_node
            assert id(node) in nodes, f"{r.rid} locks a node that is not in the tree"
            depth = tree.node_depth(node)
            assert depth <= r.kv.committed_len <= r.kv.alloc_len
            row = kv.req_to_token[r.kv.req_pool_idx]
            assert torch.equal(row[:depth], tree._path_slots(node)), f"{r.rid}: row prefix is not its locked path"
            own(row[depth:r.kv.alloc_len].tolist(), r.rid)
            while node is not tree.root:
                locks[id(node)] = locks.get(id(node), 0) + 1
                node = node.parent
        for node in nodes.values():
            if node is not tree.root:
                assert node.lock_ref == locks.get(id(node), 0), (node, locks.get(id(node), 0))
        if self.hog is not None:
            own(self.hog.tolist(), "hog")
        assert len(owners) == size, f"{size - len(owners)} KV slots leaked (owned by nobody)"

    @invariant()
    def rows_are_owned_once(self):
        if self.core is None:
            return
        rows = self.core.rows
        held = [r.kv.req_pool_idx for r in self._live()]
        free = list(rows.pool._free_rows)
        deferred = [row for row, _ in rows._released]
        every = held + free + deferred
        assert len(every) == len(set(every)) == rows.size, (held, free, deferred)

    @invariant()
    def kv_content_is_right_when_idle(self):
        """With no step in flight, every slot of the tree and of live rows holds its tokens' KV."""
        if self.core is None or self.in_flight is not None:
            return
        kv = self.core.kv
        for node, chain in self._tree_nodes():
            for slot, c in zip(node.value.tolist(), chain):
                assert self.kv_content.get(slot) == c, f"tree slot {slot} holds other KV than its path"
        for r in self._live():
            content = self.expect[r.rid].content
            for i, slot in enumerate(kv.req_to_token[r.kv.req_pool_idx, :r.kv.committed_len].tolist()):
                assert self.kv_content.get(slot) == content[i], f"{r.rid}: position {i} slot {slot} holds other KV"

    # -- the end ---------------------------------------------------------------------------------------
    def teardown(self):
        if self.core is None:
            return
        if self.hog is not None:
            self.give_memory_back()
        core = self.core
        for _ in range(MAX_DRAIN_ITERATIONS):
            if self.in_flight is None and not core.planner.has_work():
                break
            self._iteration()
        else:
            raise AssertionError("the core did not go idle")
        self.queues_are_disjoint_and_complete()
        self.outputs_follow_the_fake_model()
        self.every_slot_is_owned_once_and_locks_match()
        self.kv_content_is_right_when_idle()
        for r in self.reqs:
            assert r.finished, r.rid
            if r.finished_reason.type != "abort":
                assert r.output_ids == self.expect[r.rid].outputs[:self.expect[r.rid].length]
        core.assert_no_leaks()
        core.kv.flush()
        assert core.kv.allocator.available_size() == core.kv.allocator.size and core.kv.tree.total_size() == 0


CoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestCoreStateful = CoreMachine.TestCase

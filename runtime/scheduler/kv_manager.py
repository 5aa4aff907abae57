"""KV memory for requests: prefix matching, slot allocation with eviction, release and retraction.

Ownership: every KV slot is free, owned by the radix tree, or owned by one request's row. A
request's row holds `kv_alloc_len` slots: the tree's (matched or inserted prefix, locked
through `req.kv.last_node`) followed by its own. Positions below `kv_committed_len` hold the KV
of the request's known tokens; speculative decoding reserves slots beyond it (the verify's
positions depend on how many drafts the step in flight accepts), and plain decoding reserves
its slots a run of positions at a time (`decode_run`); only committed positions ever reach the
tree. Rows themselves come from and go back to ReqRows.
"""
from __future__ import annotations

import torch

from tandem.runtime.cache.pools import TokenAllocator, decode_run
from tandem.runtime.cache.radix import RadixCache
from tandem.runtime.scheduler.req_rows import ReqRows
from tandem.runtime.scheduler.request import Req


class KVManager:
    def __init__(self, rows: ReqRows, allocator: TokenAllocator, disable_radix_cache: bool) -> None:
        self.rows = rows
        self.req_to_token = rows.pool.req_to_token
        self.allocator = allocator
        self.tree = RadixCache(allocator, disabled=disable_radix_cache)

    # -- capacity ---------------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Slots obtainable now: free ones plus what eviction can reclaim."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def alloc_slots(self, need: int) -> torch.Tensor | None:
        if need == 0:
            return torch.empty(0, dtype=torch.int64)
        if self.allocator.available_size() < need:
            self.tree.evict(need - self.allocator.available_size())
        return self.allocator.alloc(need)

    # -- admission ----------------------------------------------------------------------------------
    def match_prefix(self, req: Req) -> tuple[torch.Tensor, object]:
        """Longest cached prefix of the request's tokens that leaves every position the request
        must compute (`Req.first_uncacheable_position`) to be computed."""
        ids = req.all_ids()
        slots, node = self.tree.match_prefix(ids[:req.first_uncacheable_position()], req.extra_key)
        return slots, node

    def start(self, req: Req, prefix_slots: torch.Tensor, node: object) -> bool:
        """Give the request a row holding its cached prefix; the prefix stays locked while it runs."""
        row = self.rows.alloc(req.sampling_params, req.output_ids)
        if row is None:
            return False
        req.kv.req_pool_idx = row
        n = len(prefix_slots)
        if n:
            self.req_to_token[row, :n] = prefix_slots.to(self.req_to_token.device)
        req.kv.alloc_len = req.kv.committed_len = n
        req.kv.last_node = node
        self.tree.inc_lock_ref(node)
        return True

    def extend(self, req: Req, new_len: int) -> torch.Tensor | None:
        """Allocate and commit positions [kv_alloc_len, kv_alloc_len + new_len): a step in flight
        computes exactly these positions."""
        slots = self.reserve(req, req.kv.alloc_len + new_len)
        if slots is not None:
            req.kv.committed_len = req.kv.alloc_len
        return slots

    def reserve(self, req: Req, upto: int) -> torch.Tensor | None:
        """Allocate slots so that positions [0, upto) have one, without committing them."""
        need = upto - req.kv.alloc_len
        slots = self.alloc_slots(max(need, 0))
        if slots is None:
            return None
        start = req.kv.alloc_len
        self.req_to_token[req.kv.req_pool_idx, start:start + len(slots)] = slots.to(self.req_to_token.device)
        req.kv.alloc_len += len(slots)
        return slots

    # -- plain decoding ------------------------------------------------------------------------------
    def decode_need(self, reqs: list[Req]) -> int:
        """Slots a plain decode step over `reqs` must allocate at least: one per request that has
        no slot reserved at its next position."""
        return sum(r.kv.alloc_len <= r.kv.committed_len for r in reqs)

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor:
        """The slot of each request's next position (`kv_committed_len`), which the step computes:
        committed here. A request with no slot reserved there gets a run (`decode_run`), or one slot
        when memory is short for runs. The caller has made sure that `decode_need(reqs)` slots are
        available."""
        fresh = [r for r in reqs if r.kv.alloc_len <= r.kv.committed_len]
        # the last sampled token is never an input: positions up to max_total_len - 2 are computed
        runs = [decode_run(r.kv.committed_len, r.max_total_len() - 2) for r in fresh]
        if sum(runs) > self.available_tokens():
            runs = [1] * len(fresh)
        slots = self.alloc_slots(sum(runs))
        assert slots is not None, "alloc_decode without decode_need(reqs) slots available"
        run_rows: list[int] = []
        run_positions: list[int] = []
        for r, n in zip(fresh, runs):  # one table write for every run (one launch on a GPU)
            run_rows += [r.kv.req_pool_idx] * n
            run_positions += range(r.kv.alloc_len, r.kv.alloc_len + n)
            r.kv.alloc_len += n
        self.req_to_token[_long(run_rows), _long(run_positions)] = slots
        positions = _long([r.kv.committed_len for r in reqs])
        for r in reqs:
            r.kv.committed_len += 1
        return self.req_to_token[_long([r.kv.req_pool_idx for r in reqs]), positions]

    def drop_decode_runs(self, reqs: list[Req]) -> bool:
        """Free the slots plain decoding reserved past each request's next position (no step
        writes them); whether any were. Memory is short: they go before anyone is retracted."""
        dropped = False
        for r in reqs:
            if r.kv.alloc_len > r.kv.committed_len:
                self.allocator.free(self.req_to_token[r.kv.req_pool_idx, r.kv.committed_len:r.kv.alloc_len])  # free copies
                r.kv.alloc_len, dropped = r.kv.committed_len, True
        return dropped

    def commit(self, req: Req) -> None:
        """After a step's tokens are applied: every token but the last has its KV written (the last
        one is the next step's input)."""
        if req.kv.req_pool_idx is not None:
            req.kv.committed_len = max(req.kv.committed_len, req.seq_len - 1)

    def cache_prefill(self, req: Req) -> None:
        """Put the request's computed-or-in-flight KV into the tree right after it is planned, so
        requests admitted after it (the n>1 siblings, shared system prompts) reuse it at once."""
        if self.tree.disabled:
            return
        n = req.kv.committed_len
        slots, node = self.tree.cache_unfinished_req(req.all_ids()[:n], self._row(req, n), req.kv.last_node, req.extra_key)
        self.req_to_token[req.kv.req_pool_idx, :n] = slots.to(self.req_to_token.device)
        req.kv.last_node = node

    # -- release --------------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        """Hand the request's KV to the tree (positions whose token is known), free the rest, and
        give its row back to ReqRows (which defers reuse past the steps in flight).

        Slots still being written by an in-flight step are safe to hand out again: every later
        step runs after that one on the same worker, in order.
        """
        row = req.kv.req_pool_idx
        if row is None:
            return
        ids = req.all_ids()
        keep = min(req.kv.committed_len, len(ids))
        slots = self._row(req, req.kv.alloc_len)
        self.tree.cache_finished_req(ids[:keep], slots[:keep], req.kv.last_node or self.tree.root, req.extra_key)
        if req.kv.alloc_len > keep:
            self.allocator.free(slots[keep:])
        self.rows.release(row)
        req.kv.req_pool_idx, req.kv.alloc_len, req.kv.committed_len, req.kv.last_node = None, 0, 0, None

    def releasable(self, reqs: list[Req]) -> int:
        """Slots that releasing every one of `reqs` would make obtainable: each one's own slots
        past its cached path, and the cached nodes that no request outside `reqs` locks (an n>1
        sibling or a request sharing a system prompt keeps their common path)."""
        locks: dict[int, list] = {}  # id(node) -> [node, locks `reqs` hold on it]
        own = 0
        for req in reqs:
            node, cached = req.kv.last_node, 0
            while node is not None and node is not self.tree.root:
                locks.setdefault(id(node), [node, 0])[1] += 1
                cached += len(node.value)
                node = node.parent
            own += req.kv.alloc_len - cached
        return own + sum(len(node.value) for node, held in locks.values() if node.lock_ref == held)

    def row_slots(self, req: Req, start: int, stop: int) -> torch.Tensor:
        """The KV slots of positions [start, stop) of the request (a copy)."""
        return self.req_to_token[req.kv.req_pool_idx, start:stop].clone()

    def _row(self, req: Req, n: int) -> torch.Tensor:
        return self.req_to_token[req.kv.req_pool_idx, :n].to("cpu").clone()

    def leak_report(self) -> str | None:
        """What is held with no request running (None: nothing). Every slot must then be free or
        the tree's, no node locked, every row free: SGLang checks the same when its scheduler
        goes idle (`check_memory`), since a leak otherwise shows only as a server that slowly
        admits less."""
        free, cached, locked = self.allocator.available_size(), self.tree.evictable_size(), self.tree.protected_size()
        problems = []
        if free + cached != self.allocator.size or locked or self.tree.total_size() != cached:
            problems.append(f"KV slots: {free} free + {cached} cached of {self.allocator.size}, "
                            f"{locked} locked, {self.tree.total_size()} in the tree")
        if self.rows.available() != self.rows.size or self.rows.num_deferred():
            problems.append(f"request rows: {self.rows.available()} free of {self.rows.size}, "
                            f"{self.rows.num_deferred()} waiting for a step")
        return "; ".join(problems) or None

    def flush(self) -> None:
        """Drop the whole cache; only legal with no request running and no step in flight."""
        self.rows.reset()
        self.tree.reset()
        self.allocator.clear()


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)

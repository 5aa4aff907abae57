"""RadixCache: matching, splitting, namespacing, locks, LRU eviction, slot ownership."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tandem.runtime.cache.pools import TokenAllocator
from tandem.runtime.cache.radix import RadixCache, TreeNode


def _setup(size: int = 64, disabled: bool = False) -> tuple[TokenAllocator, RadixCache]:
    alloc = TokenAllocator(size)
    return alloc, RadixCache(alloc, disabled=disabled)


def _put(alloc: TokenAllocator, cache: RadixCache, tokens: list[int],
         extra_key: str | None = None) -> torch.Tensor:
    """Allocate fresh slots for `tokens`, insert, free the caller's duplicates."""
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    already = cache.insert(tokens, slots, extra_key)
    alloc.free(slots[:already])
    return slots


def _sizes_consistent(cache: RadixCache) -> bool:
    return cache.evictable_size() + cache.protected_size() == cache.total_size()


def test_exact_and_prefix_match() -> None:
    alloc, cache = _setup()
    slots = _put(alloc, cache, [1, 2, 3, 4])
    full = cache.match_prefix([1, 2, 3, 4])
    assert full.slots.tolist() == slots.tolist()
    longer = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert longer.slots.tolist() == slots.tolist() and longer.last_node is full.last_node
    assert cache.match_prefix([9, 1]).slots.numel() == 0
    assert cache.match_prefix([9]).last_node is cache.root
    assert cache.match_prefix([]).slots.numel() == 0


def test_match_ending_mid_edge_splits_the_node() -> None:
    alloc, cache = _setup()
    slots = _put(alloc, cache, [1, 2, 3, 4])
    part = cache.match_prefix([1, 2, 7])
    assert part.slots.tolist() == slots[:2].tolist()
    assert part.last_node.key == [1, 2] and part.last_node.parent is cache.root
    (lower,) = part.last_node.children.values()
    assert lower.key == [3, 4] and lower.value.tolist() == slots[2:].tolist()
    assert cache.total_size() == 4 and _sizes_consistent(cache)
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == slots.tolist()
    shorter = cache.match_prefix([1])  # query ends inside the edge
    assert shorter.slots.tolist() == slots[:1].tolist() and shorter.last_node.key == [1]


def test_insert_returns_already_cached_length_and_keeps_tree_slots() -> None:
    alloc, cache = _setup(16)
    first = _put(alloc, cache, [1, 2, 3])
    second = alloc.alloc(5)
    assert second is not None
    assert cache.insert([1, 2, 3, 4, 5], second) == 3
    alloc.free(second[:3])  # the caller's duplicates: the tree kept `first`
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == first.tolist() + second[3:].tolist()
    assert cache.insert([1, 2], first[:2]) == 2  # fully cached: nothing new stored
    fresh = alloc.alloc(1)
    assert fresh is not None
    assert cache.insert([1, 2, 9], torch.cat([first[:2], fresh])) == 2  # diverges mid-edge
    assert cache.match_prefix([1, 2, 9]).slots.tolist() == first[:2].tolist() + fresh.tolist()
    assert cache.total_size() == 6 and _sizes_consistent(cache)
    assert alloc.available_size() + cache.total_size() == 16


def test_extra_key_isolates_namespaces() -> None:
    alloc, cache = _setup()
    plain = _put(alloc, cache, [1, 2, 3])
    salted = _put(alloc, cache, [1, 2, 3], extra_key="lora-a")
    assert cache.total_size() == 6  # same tokens, no sharing across extra keys
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == plain.tolist()
    assert cache.match_prefix([1, 2, 3], "lora-a").slots.tolist() == salted.tolist()
    assert cache.match_prefix([1, 2, 3], "lora-b").slots.numel() == 0
    cache.insert([1, 2, 3, 4], torch.cat([plain, alloc.alloc(1)]))  # type: ignore[list-item]
    assert cache.match_prefix([1, 2, 3, 4], "lora-a").slots.numel() == 3


def test_lock_ref_protects_path_from_eviction() -> None:
    alloc, cache = _setup(32)
    _put(alloc, cache, [1, 2, 3, 4])
    _put(alloc, cache, [1, 2, 5, 6])
    _put(alloc, cache, [7, 8])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 4
    assert cache.evict(100) == 4  # only [5, 6] and [7, 8]; [1, 2] is shared by the locked path
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 4
    assert cache.match_prefix([1, 2, 5, 6]).slots.numel() == 2
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert cache.evict(100) == 4 and cache.total_size() == 0
    assert alloc.available_size() == 32


def test_nested_locks_need_matching_unlocks() -> None:
    alloc, cache = _setup()
    _put(alloc, cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert cache.evict(10) == 0
    cache.dec_lock_ref(node)
    assert cache.evict(10) == 3
    try:
        cache.dec_lock_ref(node)
    except RuntimeError:
        pass
    else:
        raise AssertionError("unbalanced dec_lock_ref must raise")


def test_split_keeps_lock_on_both_parts() -> None:
    alloc, cache = _setup()
    _put(alloc, cache, [1, 2, 3, 4])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    upper = cache.match_prefix([1, 2]).last_node
    assert upper.lock_ref == 1 and cache.protected_size() == 4 and _sizes_consistent(cache)
    assert cache.node_depth(node) == 4
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 4 and cache.protected_size() == 0


def test_evicts_least_recently_used_leaf_first() -> None:
    alloc, cache = _setup()
    _put(alloc, cache, [1, 1])
    _put(alloc, cache, [2, 2])
    _put(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])  # now [2, 2] is the oldest
    assert cache.evict(1) == 2  # whole leaves go
    assert cache.match_prefix([2, 2]).slots.numel() == 0
    assert cache.match_prefix([3, 3]).slots.numel() == 2  # touched: [1, 1] is oldest now
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 1]).slots.numel() == 0
    assert cache.match_prefix([3, 3]).slots.numel() == 2


def test_parent_becomes_evictable_after_its_children() -> None:
    alloc, cache = _setup(16)
    _put(alloc, cache, [1, 2, 3])
    _put(alloc, cache, [1, 2, 4])
    assert cache.total_size() == 4
    assert cache.evict(3) == 4  # both leaves (1 each) then the shared [1, 2]
    assert cache.total_size() == 0 and alloc.available_size() == 16
    assert cache.evict(1) == 0


def test_evict_frees_exactly_the_tree_slots() -> None:
    alloc, cache = _setup(8)
    slots = _put(alloc, cache, [5, 6, 7])
    assert alloc.available_size() == 5
    assert cache.evict(3) == 3 and alloc.available_size() == 8
    again = alloc.alloc(8)
    assert again is not None and set(slots.tolist()) <= set(again.tolist())


def test_cache_finished_req_frees_only_duplicates() -> None:
    alloc, cache = _setup(32)
    cached = _put(alloc, cache, [1, 2])
    # request A matched [1, 2], locked it, and computed [3, 4] itself
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    own_a = alloc.alloc(2)
    assert own_a is not None
    slots_a = torch.cat([m.slots, own_a])
    # meanwhile request B cached [1, 2, 3] with its own slot for token 3
    b = alloc.alloc(3)
    assert b is not None
    assert cache.insert([1, 2, 3], b) == 2
    alloc.free(b[:2])
    before = alloc.available_size()
    cache.cache_finished_req([1, 2, 3, 4], slots_a, m.last_node)
    assert alloc.available_size() == before + 1  # A's slot for token 3 was a duplicate
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == cached.tolist() + [int(b[2]), int(own_a[1])]
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.total_size() == 32


def test_cache_unfinished_req_moves_lock_and_returns_tree_slots() -> None:
    alloc, cache = _setup(32)
    other = _put(alloc, cache, [1, 2, 3])
    m = cache.match_prefix([1, 2])
    cache.inc_lock_ref(m.last_node)
    own = alloc.alloc(3)
    assert own is not None
    slots = torch.cat([m.slots, own])  # tokens [1, 2, 3, 4, 5]; token 3 is a duplicate
    new_slots, node = cache.cache_unfinished_req([1, 2, 3, 4, 5], slots, m.last_node)
    assert new_slots.tolist() == other.tolist() + own[1:].tolist()
    assert cache.node_depth(node) == 5 and cache.protected_size() == 5
    assert cache.evictable_size() == 0 and m.last_node.lock_ref == 1  # on the locked path
    assert cache.evict(100) == 0
    cache.cache_finished_req([1, 2, 3, 4, 5], new_slots, node)
    assert cache.protected_size() == 0 and alloc.available_size() + cache.total_size() == 32


def test_disabled_cache_stores_nothing() -> None:
    alloc, cache = _setup(8, disabled=True)
    slots = alloc.alloc(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.numel() == 0 and m.last_node is cache.root
    assert cache.total_size() == 0 and cache.evict(10) == 0
    kept, node = cache.cache_unfinished_req([1, 2, 3], slots, cache.root)
    assert kept is slots and node is cache.root
    cache.cache_finished_req([1, 2, 3], slots, cache.root)
    assert alloc.available_size() == 8


def test_reset_drops_nodes_without_freeing() -> None:
    alloc, cache = _setup(8)
    _put(alloc, cache, [1, 2, 3])
    cache.reset()
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert alloc.available_size() == 5  # the caller clears the allocator itself
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
    assert "total=0" in cache.pretty_print()


# ------------------------------------------------------------------ randomized ownership


@dataclass(eq=False)
class _Req:
    tokens: list[int]
    slots: torch.Tensor  # its req_to_token row: tree slots up to its locked depth, then its own
    node: TreeNode
    extra_key: str | None


class _Sim:
    """Many requests with shared prefixes doing what the scheduler does, in random order."""

    def __init__(self, seed: int, size: int = 96) -> None:
        self.rng = random.Random(seed)
        self.size = size
        self.alloc = TokenAllocator(size)  # raises on any double free
        self.cache = RadixCache(self.alloc)
        self.reqs: list[_Req] = []
        self.kv: dict[int, tuple] = {}  # slot -> (extra_key, token prefix) whose KV it holds
        self.bases = [self._tokens(1, 8) for _ in range(4)]

    def _tokens(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(4) for _ in range(self.rng.randrange(lo, hi))]

    def _alloc(self, n: int) -> torch.Tensor | None:
        got = self.alloc.alloc(n)
        if got is None:
            self.cache.evict(n - self.alloc.available_size())
            got = self.alloc.alloc(n)
        return got

    def _write_kv(self, req: _Req, start: int) -> None:
        for i in range(start, len(req.tokens)):
            self.kv[int(req.slots[i])] = (req.extra_key, tuple(req.tokens[: i + 1]))

    def _check_slots(self, tokens: list[int], extra_key: str | None, slots: torch.Tensor) -> None:
        for i, slot in enumerate(slots.tolist()):
            assert self.kv[slot] == (extra_key, tuple(tokens[: i + 1]))

    def start(self) -> None:
        extra_key = self.rng.choice([None, None, "a"])
        tokens = self.rng.choice(self.bases) + self._tokens(0, 6)
        m = self.cache.match_prefix(tokens, extra_key)
        self._check_slots(tokens, extra_key, m.slots)
        self.cache.inc_lock_ref(m.last_node)
        own = self._alloc(len(tokens) - len(m.slots))
        if own is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        req = _Req(tokens, torch.cat([m.slots, own]), m.last_node, extra_key)
        self._write_kv(req, len(m.slots))
        self.reqs.append(req)

    def extend(self, req: _Req) -> None:
        new = self._tokens(1, 4)
        own = self._alloc(len(new))
        if own is not None:
            start = len(req.tokens)
            req.tokens, req.slots = req.tokens + new, torch.cat([req.slots, own])
            self._write_kv(req, start)

    def cache_unfinished(self, req: _Req) -> None:
        req.slots, req.node = self.cache.cache_unfinished_req(req.tokens, req.slots, req.node, req.extra_key)
        self._check_slots(req.tokens, req.extra_key, req.slots)

    def finish(self, req: _Req) -> None:
        self.reqs.remove(req)
        self.cache.cache_finished_req(req.tokens, req.slots, req.node, req.extra_key)

    def abort(self, req: _Req) -> None:
        self.reqs.remove(req)
        self.alloc.free(req.slots[self.cache.node_depth(req.node):])
        self.cache.dec_lock_ref(req.node)

    def step(self) -> None:
        roll = self.rng.random()
        if not self.reqs or roll < 0.3:
            self.start()
            return
        req = self.rng.choice(self.reqs)
        if roll < 0.5:
            self.extend(req)
        elif roll < 0.65:
            self.cache_unfinished(req)
        elif roll < 0.85:
            self.finish(req)
        elif roll < 0.92:
            self.abort(req)
        else:
            self.cache.evict(self.rng.randrange(1, 20))

    def check(self) -> None:
        nodes = _all_nodes(self.cache)
        tree_slots = [s for n in nodes for s in n.value.tolist()]
        owned = list(tree_slots)
        expected_locks: dict[int, int] = {}
        for req in self.reqs:
            depth = self.cache.node_depth(req.node)
            assert req.slots[:depth].tolist() == _path_slots(self.cache, req.node)
            owned += req.slots[depth:].tolist()
            node = req.node
            while node is not self.cache.root:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                node = node.parent  # type: ignore[assignment]
        assert len(set(owned)) == len(owned) and 0 not in owned  # nobody owns a slot twice
        assert self.alloc.available_size() + len(owned) == self.size  # and none leaked
        assert self.cache.total_size() == len(tree_slots) and _sizes_consistent(self.cache)
        assert all(n.lock_ref == expected_locks.get(id(n), 0) for n in nodes)
        locked = sum(len(n.key) for n in nodes if n.lock_ref > 0)
        assert self.cache.protected_size() == locked

    def drain(self) -> None:
        while self.reqs:
            self.finish(self.reqs[0])
        self.check()
        self.cache.evict(self.size)
        assert self.cache.total_size() == 0 and self.alloc.available_size() == self.size


def _all_nodes(cache: RadixCache) -> list[TreeNode]:
    nodes, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def _path_slots(cache: RadixCache, node: TreeNode) -> list[int]:
    parts: list[list[int]] = []
    while node is not cache.root:
        parts.append(node.value.tolist())
        node = node.parent  # type: ignore[assignment]
    return [s for part in reversed(parts) for s in part]


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_every_slot_owned_once(seed: int) -> None:
    sim = _Sim(seed)
    for _ in range(400):
        sim.step()
        sim.check()
    sim.drain()

"""Radix prefix cache: token-id sequences -> KV slot indices, with lock refs and LRU eviction.

Slot ownership (the one invariant everything here protects): every KV slot handed out by the
`TokenAllocator` is owned by exactly one of
  * the allocator (free),
  * the tree (it is in some node's `value`), or
  * a running request (it sits in the request's req_to_token row and is not in the tree).
A request's row typically mixes both: `slots[:prefix_len]` came from the tree through
`match_prefix` (tree-owned, kept alive by the request's lock on `last_node`), the rest were
allocated for the request (request-owned) until they are handed to the tree by `insert`.

`insert(tokens, slots)` returns how many leading tokens were ALREADY cached. For that prefix the
tree keeps its own slots and ignores the caller's; the caller still owns whichever of
`slots[:returned_len]` it allocated itself (duplicates) and must free them. Slots past the
returned length become tree-owned. `cache_finished_req` / `cache_unfinished_req` wrap exactly that
bookkeeping for the scheduler, so most callers never free duplicates by hand.

Keys are namespaced by `extra_key` (e.g. LoRA id or cache salt): each child is indexed by
`(extra_key, first_token)`, so sequences under different extra keys never share a node.
"""
from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import torch

from tandem.runtime.cache.pools import TokenAllocator

ChildKey = tuple[str | None, int]


class TreeNode:
    """One edge of the radix tree: a run of tokens and the KV slots that hold them."""

    __slots__ = ("key", "value", "extra_key", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, extra_key: str | None,
                 parent: TreeNode | None) -> None:
        self.key = key
        self.value = value
        self.extra_key = extra_key
        self.parent = parent
        self.children: dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


class MatchResult(NamedTuple):
    """`slots`: tree-owned KV slots of the longest cached prefix; `last_node`: its deepest node."""

    slots: torch.Tensor
    last_node: TreeNode


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    """How many tokens of `edge` equal `key[start:]` (offset instead of a slice copy)."""
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


class RadixCache:
    """SGLang-style radix prefix cache over a `TokenAllocator`'s slots.

    Scheduler flows:
      * admit: `m = match_prefix(prompt)`, `inc_lock_ref(m.last_node)`, allocate the rest.
      * finish: `cache_finished_req(kv_token_ids, row_slots, last_node)`; it inserts, frees the
        request's duplicate slots and drops the lock. Afterwards the request owns no slots.
      * chunked prefill / keep on retraction: `slots, node = cache_unfinished_req(...)`; write
        `slots` back into the request's req_to_token row and keep `node` as its locked node.
    `kv_token_ids` are the tokens whose KV is written (usually all tokens but the last sampled).
    """

    def __init__(self, allocator: TokenAllocator, disabled: bool = False) -> None:
        self.allocator = allocator
        self.disabled = disabled
        self._clock = itertools.count(1)  # logical time: deterministic LRU order, no clock ties
        self.reset()

    # ---------------------------------------------------------------- bookkeeping

    def reset(self) -> None:
        """Drop every node WITHOUT freeing slots: the caller clears the allocator (and request
        pool) itself, e.g. on /flush_cache when nothing is running."""
        self.root = TreeNode([], self._empty_slots(), None, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    def evictable_size(self) -> int:
        """Tokens held by nodes no running request locks."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens held by nodes locked by at least one running request."""
        return self._protected

    def total_size(self) -> int:
        """Tokens (= slots) the tree owns, counted by walking it."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += len(node.key)
            stack.extend(node.children.values())
        return total

    def _empty_slots(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.allocator.device)

    # ---------------------------------------------------------------- match / insert

    def match_prefix(self, token_ids: list[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached prefix of `token_ids` under `extra_key`. The returned slots stay
        tree-owned; lock `last_node` before relying on them across an eviction."""
        if self.disabled or len(token_ids) == 0:
            return MatchResult(self._empty_slots(), self.root)
        node, _ = self._walk(list(token_ids), extra_key)
        return MatchResult(self._path_slots(node), node)

    def _path_slots(self, node: TreeNode) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        while node is not self.root:
            parts.append(node.value)
            node = node.parent  # type: ignore[assignment]
        return torch.cat(parts[::-1]) if parts else self._empty_slots()

    def insert(self, token_ids: list[int], slots: torch.Tensor, extra_key: str | None = None) -> int:
        """Cache `token_ids` -> `slots`; return how many leading tokens were already cached.

        Contract: the tree keeps its existing slots for `token_ids[:returned]`, so the caller
        remains owner of `slots[:returned]` and must free those it allocated itself (slots it got
        from `match_prefix` are the tree's and must not be freed). `slots[returned:]` now belong
        to the tree. Disabled: stores nothing and returns 0 (the caller frees everything).
        """
        if len(token_ids) != len(slots):
            raise ValueError(f"insert got {len(token_ids)} tokens but {len(slots)} slots")
        if self.disabled or len(token_ids) == 0:
            return 0
        key = list(token_ids)
        node, pos = self._walk(key, extra_key)
        if pos < len(key):
            self._add_leaf(node, key[pos:], slots[pos:].clone(), extra_key)
        return pos

    def _walk(self, key: list[int], extra_key: str | None) -> tuple[TreeNode, int]:
        """Follow the cached part of `key`, splitting the edge where it ends mid-edge and
        touching every node on the way (LRU); return the deepest node and its depth."""
        tick = next(self._clock)
        node, pos = self.root, 0
        node.last_access = tick
        while pos < len(key):
            child = node.children.get((extra_key, key[pos]))
            if child is None:
                break
            matched = _common_prefix_len(child.key, key, pos)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = tick
            node, pos = child, pos + matched
        return node, pos

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor,
                  extra_key: str | None) -> TreeNode:
        leaf = TreeNode(key, value, extra_key, parent)
        leaf.last_access = parent.last_access
        parent.children[(extra_key, key[0])] = leaf
        self._evictable += len(key)  # new nodes start unlocked
        return leaf

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child`'s edge after `at` tokens; return the new upper node. `child` keeps its
        identity (and lock) as the lower part, so locked nodes never change depth."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper = TreeNode(child.key[:at], child.value[:at], child.extra_key, parent)
        upper.lock_ref = child.lock_ref  # every lock on child also covers this path
        upper.last_access = child.last_access
        parent.children[(child.extra_key, child.key[0])] = upper
        child.key, child.value, child.parent = child.key[at:], child.value[at:], upper
        upper.children[(child.extra_key, child.key[0])] = child
        return upper

    # ---------------------------------------------------------------- locks

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction (a running request uses its slots)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked radix node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ---------------------------------------------------------------- eviction

    def evict(self, num_tokens: int) -> int:
        """Free least-recently-used unlocked leaves (a parent left childless becomes a leaf
        candidate) until `num_tokens` slots went back to the allocator or nothing is
        evictable; return the number of slots freed."""
        if self.disabled or num_tokens <= 0:
            return 0
        order = itertools.count()  # tie-breaker so the heap never compares nodes
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            freed += self._remove_leaf(leaf)
            parent = leaf.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def _evictable_leaves(self) -> list[TreeNode]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _remove_leaf(self, leaf: TreeNode) -> int:
        self.allocator.free(leaf.value)
        parent = leaf.parent
        assert parent is not None
        del parent.children[(leaf.extra_key, leaf.key[0])]
        self._evictable -= len(leaf.key)
        return len(leaf.key)

    # ---------------------------------------------------------------- scheduler helpers

    def cache_finished_req(self, token_ids: list[int], slots: torch.Tensor,
                           last_locked_node: TreeNode, extra_key: str | None = None) -> None:
        """Hand a finished request's KV to the tree and release its lock.

        `slots[i]` holds the KV of `token_ids[i]`; `slots[:depth(last_locked_node)]` are the
        tree's own slots from the request's `match_prefix`. Afterwards the request owns no
        slots: duplicates are freed here, the rest belong to the tree. The request's pool row
        is the caller's to free.
        """
        if self.disabled:
            self._free(slots)  # nothing came from the tree, so every slot is the request's
            return
        self._insert_and_free_duplicates(token_ids, slots, last_locked_node, extra_key)
        self.dec_lock_ref(last_locked_node)

    def cache_unfinished_req(self, token_ids: list[int], slots: torch.Tensor,
                             last_locked_node: TreeNode, extra_key: str | None = None
                             ) -> tuple[torch.Tensor, TreeNode]:
        """Cache a still-running request's KV so far (chunked prefill, retraction keep).

        Returns the tree's slots for all of `token_ids` (write them back into the request's
        req_to_token row: some of the request's slots were duplicates and are freed now) and
        the new last node, which is locked in place of `last_locked_node`. The request keeps
        owning nothing for `token_ids`: all of it is tree-owned and locked.
        """
        if self.disabled:
            return slots, self.root
        self._insert_and_free_duplicates(token_ids, slots, last_locked_node, extra_key)
        new_slots, new_node = self.match_prefix(token_ids, extra_key)
        assert len(new_slots) == len(token_ids), "a just-inserted sequence must match in full"
        self.inc_lock_ref(new_node)  # lock the new path before unlocking the old one
        self.dec_lock_ref(last_locked_node)
        return new_slots, new_node

    def _insert_and_free_duplicates(self, token_ids: list[int], slots: torch.Tensor,
                                    last_locked_node: TreeNode, extra_key: str | None) -> None:
        """Insert, then free `slots[locked_len:already_len]`: the request allocated those, but
        the tree already held the same tokens (another request cached them meanwhile)."""
        locked_len = self.node_depth(last_locked_node)
        if locked_len > len(token_ids):
            raise ValueError("token_ids is shorter than the request's locked cached prefix")
        already_len = self.insert(token_ids, slots, extra_key)
        # the locked path covers token_ids[:locked_len], so insert walked at least that far
        assert already_len >= locked_len
        self._free(slots[locked_len:already_len])

    def _free(self, slots: torch.Tensor) -> None:
        # copy: callers pass views of req_to_token rows, and the allocator may keep the tensor
        # it is given in its pending free list while the row gets overwritten by the next request
        self.allocator.free(slots.clone())

    def node_depth(self, node: TreeNode) -> int:
        """Tokens on the path root..node (the prefix length a match ending at `node` gave)."""
        depth = 0
        while node is not self.root:
            depth += len(node.key)
            node = node.parent  # type: ignore[assignment]
        return depth

    # ---------------------------------------------------------------- debugging

    def pretty_print(self) -> str:
        """Indented dump of the tree (one line per node); also printed."""
        lines: list[str] = []
        self._format(self.root, 0, lines)
        lines.append(f"total={self.total_size()} evictable={self._evictable} protected={self._protected}")
        text = "\n".join(lines)
        print(text)
        return text

    def _format(self, node: TreeNode, indent: int, lines: list[str]) -> None:
        for child in node.children.values():
            head = child.key[:8]
            more = "..." if len(child.key) > 8 else ""
            lines.append(f"{' ' * indent}[{child.extra_key}] {head}{more} len={len(child.key)} "
                         f"lock={child.lock_ref} t={child.last_access}")
            self._format(child, indent + 2, lines)

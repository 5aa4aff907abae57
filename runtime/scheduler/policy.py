"""Waiting-queue ordering: fcfs (default), lpm (longest cached prefix first), and priority."""
from __future__ import annotations

import sys

from tandem.runtime.cache.radix import RadixCache
from tandem.runtime.scheduler.request import Req

_LPM_MAX_QUEUE = 128  # matching every waiting request each step costs too much beyond this


class SchedulePolicy:
    def __init__(self, policy: str, enable_priority: bool, tree: RadixCache, low_values_first: bool = False) -> None:
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"unknown schedule policy {policy!r}")
        self.policy = policy
        self.enable_priority = enable_priority
        self.tree = tree
        self.low_values_first = low_values_first
        # a request that names no priority is the least urgent (SGLang's _set_or_validate_priority)
        self.default_priority = sys.maxsize if low_values_first else -sys.maxsize - 1

    def urgency(self, req: Req) -> int:
        """The request's priority, larger = more urgent whichever way --schedule-low-priority-values-first
        points, so every comparison below reads one way."""
        priority = self.default_priority if req.priority is None else req.priority
        return -priority if self.low_values_first else priority

    def sort(self, waiting: list[Req]) -> None:
        """Order `waiting` in place: the head is admitted first. As SGLang's calc_priority, priority
        orders only fcfs (lpm without a radix cache is fcfs): lpm orders by cached prefix alone, and
        by arrival past _LPM_MAX_QUEUE; priority still decides preemption and who gives way in a full queue."""
        lpm = self.policy == "lpm" and not self.tree.disabled
        if lpm and len(waiting) <= _LPM_MAX_QUEUE:
            prefix = {id(r): len(self.tree.match_prefix(r.all_ids(), r.extra_key).slots) for r in waiting}
            waiting.sort(key=lambda r: (-prefix[id(r)], r.arrival_seq))
        elif self.enable_priority and not lpm:
            waiting.sort(key=lambda r: (-self.urgency(r), r.arrival_seq))
        else:
            waiting.sort(key=lambda r: r.arrival_seq)

    def retract_order(self, running: list[Req]) -> list[Req]:
        """Which running requests give way first when memory runs out: least urgent, then newest."""
        key = (lambda r: (self.urgency(r), -r.arrival_seq)) if self.enable_priority else (lambda r: -r.arrival_seq)
        return sorted(running, key=key)

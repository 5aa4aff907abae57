"""The embedded Engine refuses what it cannot run, before starting anything."""
from __future__ import annotations

import pytest

from tandem.runtime.engine import Engine


def test_engine_refuses_a_scheduler_only_node():
    with pytest.raises(ValueError, match="node_rank=1: nodes other than 0 run scheduler ranks only"):
        Engine(None, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1")

"""--dtype auto on CPU (runtime/model/runner.py pick_cpu_dtype): a rule on the CPU's flags."""
from __future__ import annotations

import time

import pytest
import torch

from tandem.runtime.model import runner
from tandem.runtime.model.config import ModelConfig

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position=512,
                  tie_word_embeddings=True, qkv_bias=False, qk_norm=False)


@pytest.mark.parametrize("flags, want", [
    (set(), torch.float32),
    ({"avx512_bf16"}, torch.float32),
    ({"amx_bf16", "avx512_bf16"}, torch.bfloat16),
])
def test_auto_dtype_is_a_rule_on_the_cpu_flags_never_a_timing(monkeypatch, flags, want) -> None:
    """The same CPU gets the same dtype on every start, however its matmuls time (a timed choice
    flipped between starts near its threshold, and every answer with it)."""
    monkeypatch.setattr(runner, "cpu_flags", lambda: flags)
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("--dtype auto timed something"))
    picks = {runner.pick_cpu_dtype(CFG) for _ in range(3)}
    assert len(picks) == 1
    dtype, why = picks.pop()
    assert dtype == want and why

"""The GEMM-only bound's arithmetic and --dtype auto's choice on CPU."""
from __future__ import annotations

import pytest
import torch

from tandem.launch import gemm_bound as gb
from tandem.runtime.model.config import ModelConfig

CFG = ModelConfig(arch="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position=512,
                  tie_word_embeddings=True, qkv_bias=False, qk_norm=False)


def test_seconds_count_prefill_tokens_and_full_decode_steps() -> None:
    bound = gb.GemmBound(decode_batch=8, decode_step_s=0.1, prefill_s_per_token=0.001)
    assert bound.decode_tok_s == pytest.approx(80.0)
    assert bound.seconds(100, 17) == pytest.approx(0.1 + 3 * 0.1)  # 17 tokens at batch 8: 3 steps
    assert bound.tok_s(100, 17) == pytest.approx(17 / 0.4)


def test_measure_times_are_positive_at_any_batch() -> None:
    # no comparison of the two timings: tests never assert times (a loaded machine reorders them)
    for batch in (1, 512):
        bound = gb.measure(CFG, torch.float32, batch)
        assert bound.decode_batch == batch and 0 < bound.decode_step_s and 0 < bound.prefill_s_per_token


@pytest.mark.parametrize("layout", ["mkl", "onednn", "bf16"])
def test_the_c_plus_plus_pass_runs_every_weight_layout(monkeypatch, layout) -> None:
    """The layers' matmuls run from C++ (a wrong slice between two linears fails their shapes)."""
    if layout == "bf16" and not gb.packs_weights(torch.bfloat16):
        layout = "onednn"  # no native bf16 here: fp32's oneDNN layout covers the blocked weights
    monkeypatch.setattr("tandem.runtime.model.packed_linear.fp32_layout", lambda: (layout, "test"))
    calls = []
    ops = gb.load_cpu_ops()
    assert ops is not None, "the CPU ops did not build: see the warning logged by load_cpu_ops"
    counting = type("CountingOps", (), {"layer_matmuls": staticmethod(lambda *a: calls.append(a) or ops.layer_matmuls(*a))})
    monkeypatch.setattr(gb, "load_cpu_ops", counting)
    bound = gb.measure(CFG, torch.bfloat16 if layout == "bf16" else torch.float32, 70, repeats=1)
    assert bound.decode_step_s > 0 and calls
    assert len(calls[0][1]) == 8 * CFG.num_layers  # (weight, like) for four linears a layer


def test_without_the_c_plus_plus_ops_the_pass_runs_from_python(monkeypatch) -> None:
    monkeypatch.setattr(gb, "load_cpu_ops", lambda: None)
    assert gb.measure(CFG, torch.float32, 4, repeats=1).decode_step_s > 0

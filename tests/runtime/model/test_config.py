"""config.json's rope settings, in both layouts transformers writes, against transformers itself (fp32)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

LOGIT_ATOL = 1e-3  # the fp32 budget of test_model_vs_hf.py

# rope settings as transformers 5 writes them (one rope_parameters dict); theta 1e6 as Qwen2's
ROPE = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
}


def _with_config(src: str, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _logits_diff(path: str) -> float:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=1024, max_running_requests=2, dtype="float32"))
    ids = list(range(300, 600))  # past original_max_position_embeddings, where the scalings differ
    loop, row = BareLoop(runner), runner.req_to_token_pool.alloc()
    try:
        ours = loop.prefill([ids], [row], all_logits=True)
    finally:
        loop.release([row], [len(ids)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    return (ours - ref).abs().max().item()


@pytest.mark.parametrize("kind", sorted(ROPE))
def test_rope_parameters_match_transformers(tiny_model_dir, tmp_path, kind):
    path = _with_config(tiny_model_dir("qwen2"), tmp_path / kind, rope_parameters=ROPE[kind])
    assert _logits_diff(path) < LOGIT_ATOL


def test_legacy_rope_theta_and_rope_scaling_match_transformers(tiny_model_dir, tmp_path):
    """transformers 4's layout: rope_theta at the top, the scaling in rope_scaling with `type`."""
    path = _with_config(tiny_model_dir("llama"), tmp_path / "legacy", rope_parameters=None, rope_theta=5e5,
                        rope_scaling={"type": "linear", "factor": 2.0})
    assert _logits_diff(path) < LOGIT_ATOL


def test_linear_rope_scaling_stretches_the_context_as_sglang():
    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                    "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "max_position_embeddings": 2048,
                                    "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}})
    assert (cfg.rope_theta, cfg.max_position) == (1e4, 8192)


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_is_refused_naming_the_field(field):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, field: {"rope_type": "longrope", "factor": 2.0}}
    with pytest.raises(ValueError, match=rf"{field}\.rope_type 'longrope' is not supported"):
        ModelConfig.from_hf_dict(cfg)

"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on tiny random checkpoints built with transformers:
logits and greedy equal transformers' in fp32 on every attention backend (and so every fused-MoE
path: the torch loop, the C++ op, the Triton kernel), Qwen3-MoE's dense layers and unnormalized
top-k weights, TP 2 equal to TP 1 within the all-reduce's rounding, a prompt's logits the same bits
alone or batched, the expert split and the refusals."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.launch.bare_loop import BareLoop
from tandem.launch.make_tiny_model import build_tiny_model
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.moe import SparseMoE
from tandem.runtime.model.packed_linear import packs_weights
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.model.tensor_parallel import TensorParallel, check_divisible, shard_weights
from tandem.runtime.server_args import ServerArgs
from tp_runner import assert_tp2_equals_tp1

pytestmark = pytest.mark.timeout(600)

LOGIT_ATOL = 1e-3  # the fp32 budget of test_model_vs_hf.py
PROMPT = list(range(200, 260))


def _runner(path: str, backend: str = "auto", dtype: str = "float32") -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, max_total_tokens=4096, max_running_requests=40, dtype=dtype,
                                  attention_backend=backend))


def _prefill_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    loop = BareLoop(runner)
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    try:
        return loop.prefill(prompts, rows, all_logits=True)
    finally:
        loop.release(rows, [len(p) for p in prompts])


def _compare(path: str, backend: str, new: int) -> None:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = _runner(path, backend)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
        want = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                           do_sample=False, max_new_tokens=new)[0, len(PROMPT):].tolist()
    assert (_prefill_logits(runner, [PROMPT]) - ref).abs().max().item() < LOGIT_ATOL
    assert BareLoop(runner).generate([PROMPT], new).output_ids[0] == want


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_logits_and_greedy_equal_transformers(tiny_model_dir, arch, backend):
    _compare(tiny_model_dir(arch), backend, 6 if backend == "triton" else 24)


def test_qwen3_moe_dense_layers_and_unnormalized_top_k(tmp_path):
    """mlp_only_layers and decoder_sparse_step make dense layers; norm_topk_prob false keeps the
    softmax's top-k weights as they are."""
    path = str(build_tiny_model(tmp_path / "dense", "qwen3_moe", layers=4, norm_topk_prob=False,
                                mlp_only_layers=[0], decoder_sparse_step=2, num_experts_per_tok=3))
    cfg = _runner(path).config
    assert cfg.dense_layers == (0, 2) and not cfg.norm_topk_prob and cfg.num_experts_per_tok == 3
    _compare(path, "cpu", 12)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tp2_equals_tp1(tiny_model_dir, tmp_path, arch):
    assert_tp2_equals_tp1(tiny_model_dir(arch), str(tmp_path / "tp2.pt"))


DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not packs_weights(torch.bfloat16), reason="no native bf16 on this CPU: bf16 runs torch's reference linear"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_prompt_gets_the_same_bits_alone_and_batched(tiny_model_dir, arch, dtype):
    """Prefill beside 5 other prompts and a decode step beside 6 others: torch.equal to alone."""
    runner = _runner(tiny_model_dir(arch), "cpu", dtype)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 4000, (40,), generator=g).tolist()
    others = [torch.randint(3, 4000, (int(n),), generator=g).tolist() for n in torch.randint(1, 50, (6,), generator=g)]
    alone = _prefill_logits(runner, [prompt])
    batched = _prefill_logits(runner, others[:2] + [prompt] + others[2:5])
    start = sum(len(p) for p in others[:2])
    assert torch.equal(batched[start:start + len(prompt)], alone)
    loop = BareLoop(runner)
    alone_steps = loop.generate([prompt], 4, keep_logits=True).step_logits
    batch_steps = loop.generate(others[:3] + [prompt] + others[3:], 4, keep_logits=True).step_logits
    for a, b in zip(alone_steps, batch_steps):
        assert torch.equal(a[0], b[3])


def test_experts_split_by_intermediate_width_and_put_back_together():
    cfg = ModelConfig.from_hf_dict({"architectures": ["MixtralForCausalLM"], "vocab_size": 8, "hidden_size": 4,
                                    "intermediate_size": 6, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "num_key_value_heads": 2, "head_dim": 2, "num_local_experts": 3,
                                    "num_experts_per_tok": 2})
    gate_up, down = torch.arange(3 * 12 * 4.).view(3, 12, 4), torch.arange(3 * 4 * 6.).view(3, 4, 6)
    weights = {"layers.0.mlp.experts.gate_up_proj": gate_up, "layers.0.mlp.experts.down_proj": down,
               "layers.0.mlp.gate.weight": torch.ones(3, 4)}
    shards = [shard_weights(weights, cfg, TensorParallel(rank, 2)) for rank in (0, 1)]
    # rank r: rows 3r..3r+2 of each expert's gate (rows 0-5) and of its up (rows 6-11)
    assert torch.equal(shards[1]["layers.0.mlp.experts.gate_up_proj"], gate_up[:, [3, 4, 5, 9, 10, 11]])
    assert torch.equal(torch.cat([s["layers.0.mlp.experts.down_proj"] for s in shards], dim=2), down)
    assert all(torch.equal(s["layers.0.mlp.gate.weight"], weights["layers.0.mlp.gate.weight"]) for s in shards)
    with pytest.raises(ValueError, match="expert intermediate size"):
        check_divisible(cfg, 4)


BASE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 4, "intermediate_size": 6,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 2}


@pytest.mark.parametrize("change, named", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": None}, "num_experts"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"architectures": ["MixtralForCausalLM"], "hidden_act": "relu"}, "hidden_act"),
])
def test_what_tandem_cannot_compute_is_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_dict(BASE | change)


def test_the_model_builds_experts_where_the_config_says(tmp_path):
    path = str(build_tiny_model(tmp_path / "m", "qwen3_moe", layers=3, mlp_only_layers=[1]))
    model = _runner(path, "torch").model
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == [True, False, True]
    assert model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)

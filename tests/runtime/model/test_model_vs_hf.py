"""tandem's model against transformers on the same checkpoints (fp32)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.launch.bare_loop import BareLoop, LoopSampling
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

# fp32 with the same weights: only reduction order may differ (fused qkv/gate_up matmuls, SDPA
# vs eager softmax). Over 30 layers that stays well under 1e-3 absolute on logits of magnitude ~30.
LOGIT_ATOL = 1e-3

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]


def _prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    row = runner.req_to_token_pool.alloc()
    loop = BareLoop(runner)
    try:
        return loop.prefill([ids], [row], all_logits=True)
    finally:
        loop.release([row], [len(ids)])


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    def make(arch: str):
        path = tiny_model_dir(arch)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return hf, ModelRunner(ServerArgs(model_path=path, max_total_tokens=4096, max_running_requests=8,
                                                    dtype="float32"))
    return make


def test_smollm2_gguf_logits_match_transformers(smol_runner, hf_smol, smol_tokenizer):
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        ours = _prefill_logits(smol_runner, ids)
        with torch.no_grad():
            ref = hf_smol(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_random_logits_match_transformers(tiny_pair, arch):
    hf, runner = tiny_pair(arch)
    ids = list(range(200, 260))
    ours = _prefill_logits(runner, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < LOGIT_ATOL


def test_greedy_32_tokens_equal_transformers_generate(smol_runner, hf_smol, smol_tokenizer):
    loop = BareLoop(smol_runner)
    for prompt in PROMPTS:
        ids = smol_tokenizer(prompt)["input_ids"]
        ours = loop.generate([ids], 32).output_ids[0]
        with torch.no_grad():
            ref = hf_smol.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=32)[0, len(ids):].tolist()
        assert len(ref) >= 2 and ours[:len(ref)] == ref, prompt  # transformers stops at EOS, the bare loop does not


def test_extend_after_cached_prefix_equals_full_prefill(smol_runner, smol_tokenizer):
    ids = smol_tokenizer(" ".join(PROMPTS))["input_ids"]
    full = _prefill_logits(smol_runner, ids)
    loop, row = BareLoop(smol_runner), smol_runner.req_to_token_pool.alloc()
    try:
        split = len(ids) // 3
        loop.prefill([ids[:split]], [row], all_logits=True)
        rest = loop.prefill([ids], [row], prefix_lens=[split], all_logits=True)
    finally:
        loop.release([row], [len(ids)])
    assert (rest - full[split:]).abs().max().item() < LOGIT_ATOL  # same fp32 reduction-order budget


def test_batch_of_mixed_lengths_equals_each_alone(smol_runner, smol_tokenizer):
    loop = BareLoop(smol_runner)
    prompts = [smol_tokenizer(p)["input_ids"] for p in PROMPTS]
    batched = loop.generate(prompts, 24, keep_logits=True)
    for i, ids in enumerate(prompts):
        alone = loop.generate([ids], 24, keep_logits=True)
        for step, (a, b) in enumerate(zip(alone.output_ids[0], batched.output_ids[i])):
            if a != b:
                # fp32 reduction order may flip an exact near-tie: only allowed where the top two agree to 1e-4
                logp = torch.log_softmax(alone.step_logits[step][0], -1)
                top2 = logp.topk(2).values
                assert (top2[0] - top2[1]).abs().item() < 1e-4, (i, step)
                break


def test_seeded_sampling_is_reproducible_and_batch_independent(smol_runner, smol_tokenizer):
    loop = BareLoop(smol_runner)
    ids = smol_tokenizer(PROMPTS[2])["input_ids"]
    other = smol_tokenizer(PROMPTS[1])["input_ids"]
    seeded = LoopSampling(temperature=0.9, top_p=0.95, top_k=50, seed=42)
    first = loop.generate([ids], 16, seeded).output_ids[0]
    again = loop.generate([ids], 16, seeded).output_ids[0]
    mixed = loop.generate([other, ids], 16, [LoopSampling(temperature=1.0), seeded]).output_ids[1]
    assert first == again == mixed
    different_seed = loop.generate([ids], 16, LoopSampling(temperature=0.9, top_p=0.95, top_k=50, seed=7)).output_ids[0]
    assert different_seed != first


@pytest.mark.parametrize("arch,flag", [("llama", "attention_bias"), ("llama", "mlp_bias"), ("qwen3", "attention_bias")])
def test_biases_the_config_declares_match_transformers(tmp_path, arch, flag):
    """transformers' Llama biases q/k/v and o_proj with attention_bias, gate/up/down with mlp_bias;
    Qwen3 q/k/v and o_proj with attention_bias."""
    import transformers

    name = {"llama": "Llama", "qwen3": "Qwen3"}[arch]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True, **{flag: True})
    torch.manual_seed(0)
    hf = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if p.dim() == 2 or pname.endswith("bias"):  # the default init is tiny and its biases zero
                p.normal_(0.0, 0.08 if p.dim() == 2 else 0.3)
    hf.save_pretrained(str(tmp_path))
    runner = ModelRunner(ServerArgs(model_path=str(tmp_path), max_total_tokens=512, max_running_requests=2,
                                    dtype="float32"))
    ids = list(range(100, 160))
    ours = _prefill_logits(runner, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < LOGIT_ATOL

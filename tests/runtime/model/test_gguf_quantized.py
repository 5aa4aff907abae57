"""The shipped Q4_1 GGUF (and its Q8_0 conversion, by the gguf package's quantizer) served
quantized against the same file dequantized (--quantization none, the reference path).

The stated bound, from the kernel's arithmetic (kernels/csrc/gguf_linear_cpu.cpp): the weights are
the file's exactly; the only approximation is the activations' 16-bit quantization per 32-input
block, an error of at most max|x| / 65024 of the block, 1/128 of a bf16 rounding (2^-9 of a
value) at the block's largest input. On these prompts the bf16 reference path (every activation
rounded to bf16) moves chosen-token logprobs off the fp32 path's by at most ~0.3 nats and any
logprob by ~0.85, so the quantized path in fp32 is expected within 1/128 of that: 0.0023 and 0.0066.
Bounds with 4x margin: LOGPROB_BOUND for chosen tokens, ANY_LOGPROB_BOUND for every vocabulary
entry (measured: 0.0026 and 0.019). Greedy ids must be equal, except where the reference's top
two are within 2 * LOGPROB_BOUND (a perturbation inside the bound may swap them). In bf16 both
paths round every activation to bf16: the quantized one must be no farther from the fp32 reference
than the dequantized bf16 path is (within 1.5x). On a CPU with AMX-BF16, bf16 activations take the
bf16-tile arithmetic (weights dequantized on the fly to the dequantized path's bf16 values, summed by
the same TDPBF16PS sequence as its AMX linear): there the two paths' logits are equal bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.quant.gguf_load import GgufEmbedding, GgufLinear
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.model_files import default_model_path
from tandem.runtime.server_args import ServerArgs

from quant_checkpoints import prefill_logprobs

LOGPROB_BOUND = 0.01
ANY_LOGPROB_BOUND = 0.03
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
TOKENS = 32


def _runner(path: str | None, dtype: str, quantization: str) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, max_total_tokens=2048, max_running_requests=8, dtype=dtype,
                                  quantization=quantization))


@pytest.fixture(scope="module")
def q8_path():
    from tandem.launch.gguf_convert import converted

    return converted(default_model_path(), "q8_0")


@pytest.fixture(scope="module")
def runners(q8_path):
    made: dict[tuple, ModelRunner] = {}

    def get(file: str, dtype: str, quantization: str) -> ModelRunner:
        key = (file, dtype, quantization)
        if key not in made:
            made[key] = _runner(None if file == "q4_1" else q8_path, dtype, quantization)
        return made[key]
    return get




def _compare(ref: ModelRunner, ours: ModelRunner, ids: list[int]) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """Greedy ids of each, and both runners' teacher-forced logprobs along the reference's."""
    want = BareLoop(ref).generate([ids], TOKENS).output_ids[0]
    got = BareLoop(ours).generate([ids], TOKENS).output_ids[0]
    seq = ids + want
    return want, got, prefill_logprobs(ref, seq)[len(ids) - 1:-1], prefill_logprobs(ours, seq)[len(ids) - 1:-1]


def test_the_shipped_file_is_served_quantized(runners, smol_tokenizer):
    runner = runners("q4_1", "float32", "gguf")
    model = runner.model
    assert isinstance(model.embed_tokens, GgufEmbedding) and model.embed_tokens.weight.qtype == "q8_0"
    assert all(isinstance(m, GgufLinear) and m.weight.qtype == "q4_1" for layer in model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    info = runner.weight_info()
    assert info["weight_quantization"] == "gguf:q4_1+q8_0"
    import os

    size = os.path.getsize(default_model_path())
    assert size * 0.95 < info["weight_bytes"] <= size * 1.25  # the file's blocks, plus the norms and padding
    assert runners("q4_1", "float32", "none").weight_info()["weight_bytes"] > 4 * size


@pytest.mark.parametrize("file", ["q4_1", "q8_0"])
def test_fp32_greedy_and_logprobs_match_the_dequantized_path(runners, smol_tokenizer, file):
    ref, ours = runners(file, "float32", "none"), runners(file, "float32", "gguf")
    for prompt in PROMPTS:
        want, got, lp_ref, lp = _compare(ref, ours, smol_tokenizer(prompt)["input_ids"])
        target = torch.tensor(want)[:, None]
        chosen = (lp.gather(1, target) - lp_ref.gather(1, target)).abs().max().item()
        assert chosen <= LOGPROB_BOUND, (prompt, chosen)
        assert (lp - lp_ref).abs().max().item() <= ANY_LOGPROB_BOUND, prompt
        if got != want:
            step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            top2 = lp_ref[step].topk(2).values
            assert (top2[0] - top2[1]).item() < 2 * LOGPROB_BOUND, (prompt, step)


def test_bf16_is_no_farther_from_the_fp32_reference_than_the_dequantized_bf16_path(runners, smol_tokenizer):
    ref = runners("q4_1", "float32", "none")
    worst = {}
    for quantization in ("none", "gguf"):
        ours = runners("q4_1", "bfloat16", quantization)
        gaps = []
        for prompt in PROMPTS:
            want, _, lp_ref, lp = _compare(ref, ours, smol_tokenizer(prompt)["input_ids"])
            target = torch.tensor(want)[:, None]
            gaps.append((lp.gather(1, target) - lp_ref.gather(1, target)).abs().max().item())
        worst[quantization] = max(gaps)
    assert worst["gguf"] <= 1.5 * worst["none"], worst


def test_bf16_on_amx_is_the_dequantized_bf16_path_bit_for_bit(runners, smol_tokenizer):
    from tandem.kernels.cpu_ops import load_cpu_ops

    if not load_cpu_ops().gguf_isa().startswith("amx_bf16"):
        pytest.skip("this CPU (or kernel) gives no AMX-BF16 to the process: bf16 takes the integer arithmetic")
    prompts = [smol_tokenizer(p)["input_ids"] for p in PROMPTS]
    ref = BareLoop(runners("q4_1", "bfloat16", "none")).generate(prompts, 16, keep_logits=True)
    ours = BareLoop(runners("q4_1", "bfloat16", "gguf")).generate(prompts, 16, keep_logits=True)
    assert ours.output_ids == ref.output_ids
    assert all(torch.equal(a, b) for a, b in zip(ours.step_logits, ref.step_logits))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_decode_step_takes_the_quantized_linears(runners, smol_tokenizer, monkeypatch, dtype):
    """decode_layers (C++) calls the quantized op for each linear: the same bits as the modules."""
    runner = runners("q4_1", dtype, "gguf")
    model, ids = runner.model, smol_tokenizer(PROMPTS[2])["input_ids"]
    loop = BareLoop(runner)

    def run(step: str):
        monkeypatch.setenv("TANDEM_CPU_DECODE_STEP", step)
        model._decode_step_checked_for = None  # built again under the switch
        out = loop.generate([ids, ids[:5]], 8, keep_logits=True)
        assert (model._decode_step is not None) == (step == "1")
        return out

    fused, modules = run("1"), run("0")
    assert fused.output_ids == modules.output_ids
    assert all(torch.equal(a, b) for a, b in zip(fused.step_logits, modules.step_logits))


def test_a_row_gets_the_same_logits_alone_and_batched(runners, smol_tokenizer):
    loop = BareLoop(runners("q4_1", "bfloat16", "gguf"))
    prompts = [smol_tokenizer(p)["input_ids"] for p in PROMPTS]
    batched = loop.generate(prompts, 8, keep_logits=True)
    for i, ids in enumerate(prompts):
        alone = loop.generate([ids], 8, keep_logits=True)
        assert alone.output_ids[0] == batched.output_ids[i]
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone.step_logits, batched.step_logits))


def test_quantization_none_and_other_models_keep_the_dequantized_path(runners, tiny_model_dir):
    assert runners("q4_1", "float32", "none").weight_info()["weight_quantization"] == "none"
    tiny = ModelRunner(ServerArgs(model_path=tiny_model_dir("llama"), max_total_tokens=256, max_running_requests=2,
                                  dtype="float32"))
    assert tiny.weight_info()["weight_quantization"] == "none"  # unset: a HF folder is served in --dtype
    with pytest.raises(ValueError, match="--quantization gguf: the model is not a GGUF file"):
        ModelRunner(ServerArgs(model_path=tiny_model_dir("llama"), max_total_tokens=256, max_running_requests=2,
                               dtype="float32", quantization="gguf"))


def test_weight_updates_are_refused_on_quantized_weights(runners):
    from tandem.runtime.model import weight_update

    runner = runners("q4_1", "float32", "gguf")
    with pytest.raises(ValueError, match="holds this weight quantized"):
        weight_update.check(runner.model, runner.config, runner.tp,
                            [("model.layers.0.self_attn.q_proj.weight", torch.zeros(576, 576))])
    # a norm is held as it always is: still updatable
    assert weight_update.check(runner.model, runner.config, runner.tp,
                               [("model.layers.0.input_layernorm.weight", torch.ones(576))])

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

K-quants: the gguf package cannot quantize them, so the test writes its own (a plain min/max
quantizer, in _K_QUANTIZERS) into a copy of the shipped file whose 30 down_proj weights (the only
linears with whole 256-input super-blocks: 1536 inputs) are Q4_K, Q5_K and Q6_K by turns. Like
llama.cpp's Q4_K_M files (Q5_0 where a K-quant does not fit, a Q8_0 v in some layers), the copy also
mixes types inside fused linears (_MIXED: by the gguf package's Q5_0, Q5_1 and Q8_0 quantizers):
those are served as groups of parts. The same bounds and the bf16 bit-for-bit check hold against
that file dequantized.
"""
from __future__ import annotations

import numpy as np
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


def _fp16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes [..., 2], the float32 value they hold)"""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(*values.shape, 2), half.astype(np.float32)


def _q45_k(w: np.ndarray, five: bool) -> np.ndarray:
    """[B, 256] float32 -> Q4_K / Q5_K super-blocks [B, 144 / 176]: per 32 inputs a 6-bit scale and min."""
    qmax = 31 if five else 15
    sub = w.reshape(-1, 8, 32)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale, offset = (high - low) / qmax, -low
    d_bytes, d = _fp16(scale.max(-1) / 63)
    m_bytes, dm = _fp16(offset.max(-1) / 63)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(offset / np.where(dm > 0, dm, 1)[:, None]), 0, 63).astype(np.uint8)
    step, shift = d[:, None] * sc, dm[:, None] * mn
    u = np.clip(np.round((sub + shift[..., None]) / np.where(step > 0, step, 1)[..., None]), 0, qmax).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], axis=-1)
    qs = ((u[:, 0::2] & 15) | (u[:, 1::2] & 15) << 4).reshape(-1, 128)  # sub-blocks 2c, 2c + 1 in 32 bytes
    parts = [d_bytes, m_bytes, scales]
    if five:
        parts.append(np.bitwise_or.reduce((u >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate(parts + [qs], axis=-1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """[B, 256] float32 -> Q6_K super-blocks [B, 210]: per 16 inputs an 8-bit signed scale."""
    sub = w.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d_bytes, d = _fp16(scale.max(-1) / 127)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    u = (np.clip(np.round(sub / np.where(step != 0, step, 1)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    halves = u.reshape(-1, 2, 2, 64)  # [chunk of 128][nibble][64]
    ql = ((halves[:, :, 0] & 15) | (halves[:, :, 1] & 15) << 4).reshape(-1, 128)
    quarters = u.reshape(-1, 2, 4, 32) >> 4  # [chunk][bit pair][32]
    qh = np.bitwise_or.reduce(quarters << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=-1)


_K_QUANTIZERS = {12: lambda w: _q45_k(w, False), 13: lambda w: _q45_k(w, True), 14: _q6_k}


# tensor -> its type in even and odd layers of the K file (None: the shipped file's Q4_1): q/k/v and
# gate/up of several types in one layer, as in llama.cpp's Q4_K_M files
_MIXED = {"attn_q": (6, None), "attn_k": (6, None), "attn_v": (8, 7), "ffn_gate": (6, None), "ffn_up": (7, None)}


def _k_file(src: str, dst: str) -> str:
    """`src` with its ffn_down weights in Q4_K, Q5_K, Q6_K by turns (layer i: type 12 + i % 3), and
    its other linears' types mixed as _MIXED says."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields[gguf.Keys.General.ARCHITECTURE].contents(), endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    tensors = []
    for t in reader.tensors:
        data, kind = np.asarray(t.data), t.tensor_type
        if t.name.endswith("ffn_down.weight"):
            out, k = (int(d) for d in reversed(t.shape))
            kind = gguf.GGMLQuantizationType(12 + int(t.name.split(".")[1]) % 3)
            weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1, 256)
            data = _K_QUANTIZERS[kind](weight).reshape(out, -1)
            again = dequantize(data, kind).reshape(-1, 256)  # the quantizer's blocks are well-formed
            assert np.abs(again - weight).max() <= np.abs(weight).max() * 0.1, t.name
        elif (kinds := _MIXED.get(t.name.split(".")[-2])) and kinds[int(t.name.split(".")[1]) % 2] is not None:
            kind = gguf.GGMLQuantizationType(kinds[int(t.name.split(".")[1]) % 2])
            data = quantize(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32), kind)
        tensors.append(data)
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return dst


@pytest.fixture(scope="module")
def k_path(tmp_path_factory):
    return _k_file(default_model_path(), str(tmp_path_factory.mktemp("gguf_k") / "smollm2-k.gguf"))


@pytest.fixture(scope="module")
def runners(request):
    made: dict[tuple, ModelRunner] = {}
    paths = {"q4_1": lambda: None, "q8_0": lambda: request.getfixturevalue("q8_path"),
             "k": lambda: request.getfixturevalue("k_path")}

    def get(file: str, dtype: str, quantization: str) -> ModelRunner:
        key = (file, dtype, quantization)
        if key not in made:
            made[key] = _runner(paths[file](), dtype, quantization)
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


def test_a_k_quant_file_is_served_quantized(runners):
    model = runners("k", "float32", "gguf").model
    kinds = [layer.mlp.down_proj.weight.qtype for layer in model.layers]
    assert kinds == [("q4_k", "q5_k", "q6_k")[i % 3] for i in range(len(model.layers))]
    assert [layer.self_attn.qkv_proj.weight.qtype for layer in model.layers[:2]] == ["q5_0+q5_0+q8_0", "q4_1+q4_1+q5_1"]
    assert [layer.mlp.gate_up_proj.weight.qtype for layer in model.layers[:2]] == ["q5_0+q5_1", "q4_1"]
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())  # every linear held quantized
    assert runners("k", "float32", "gguf").weight_info()["weight_quantization"] == \
        "gguf:q4_1+q4_k+q5_0+q5_1+q5_k+q6_k+q8_0"


@pytest.mark.parametrize("file", ["q4_1", "q8_0", "k"])
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


@pytest.mark.parametrize("file", ["q4_1", "k"])
def test_bf16_on_amx_is_the_dequantized_bf16_path_bit_for_bit(runners, smol_tokenizer, file):
    from tandem.kernels.cpu_ops import load_cpu_ops

    if not load_cpu_ops().gguf_isa().startswith("amx_bf16"):
        pytest.skip("this CPU (or kernel) gives no AMX-BF16 to the process: bf16 takes the integer arithmetic")
    prompts = [smol_tokenizer(p)["input_ids"] for p in PROMPTS]
    ref = BareLoop(runners(file, "bfloat16", "none")).generate(prompts, 16, keep_logits=True)
    ours = BareLoop(runners(file, "bfloat16", "gguf")).generate(prompts, 16, keep_logits=True)
    assert ours.output_ids == ref.output_ids
    assert all(torch.equal(a, b) for a, b in zip(ours.step_logits, ref.step_logits))


@pytest.mark.parametrize("file", ["q4_1", "k"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_decode_step_takes_the_quantized_linears(runners, smol_tokenizer, monkeypatch, dtype, file):
    """decode_layers (C++) calls the quantized op for each linear: the same bits as the modules."""
    runner = runners(file, dtype, "gguf")
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


@pytest.mark.parametrize("file,dtype", [("q4_1", "bfloat16"), ("k", "bfloat16"), ("k", "float32")])
def test_a_row_gets_the_same_logits_alone_and_batched(runners, smol_tokenizer, file, dtype):
    loop = BareLoop(runners(file, dtype, "gguf"))
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


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                  "model.layers.1.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight",
                                  "model.embed_tokens.weight"])
def test_get_weights_by_name_reads_a_quantized_weight_as_the_dequantized_path_holds_it(runners, name):
    """A weight held quantized (a part of a mixed group, a fused Q4_1 q/k/v, a K-quant, the embedding)
    reads back dequantized exactly as `--quantization none` holds it in float32."""
    from types import SimpleNamespace

    from tandem.ipc.messages import WeightsReq
    from tandem.runtime.scheduler.weights_control import WeightsControl

    def values(runner: ModelRunner) -> list:
        control = WeightsControl(SimpleNamespace(model=runner.model, config=runner.config, tp=runner.tp), worker=None)
        return control._get_by_name(WeightsReq(req_id=0, op="get_by_name", name=name, truncate_size=10**6)).values

    got, want = values(runners("k", "float32", "gguf")), values(runners("k", "float32", "none"))
    assert len(got) == len(want) > 0 and got == want

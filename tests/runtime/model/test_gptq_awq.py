"""GPTQ and AWQ int4 checkpoints (runtime/model/quant/gptq_awq.py): tiny checkpoints written here
through the formats' own packing (AutoGPTQ's word loop with v1's stored zero - 1, GPTQModel's v2,
AutoAWQ's interleaved column order), served on the GGUF int4 kernels, against a plain float32
checkpoint holding the same dequantized weights s * (q - zero).

The bound, from the arithmetic, relative to what the int4 rounding itself does to the model (the
reference's logprobs against the unquantized model's, `shift`): the int4 rounding moves each weight
by up to s / 2, about 0.29 s rms, independently per weight. Q4_1 (asymmetric GPTQ, AWQ) moves
each weight further by m's fp16 rounding, at most 2^-11 |s * zero| <= s / 128, the same for a
block's 32 weights: against a 32-input block's sum that is at most s / 128 * |sum x| beside the
rounding's 0.29 s * |x|_2, 1/37 for inputs of random sign, so Q4_1's logprobs stay within
shift / 32. Q4_0 (symmetric GPTQ) holds the weights exactly; only the fp32 kernel's 16-bit
activations remain (within max|x| / 65024 of a block, 2^-16 against the int4 rounding's ~2^-4 of a
weight): within shift / 1024. Measured: Q4_1 shift / 190 to / 240, Q4_0 shift / 5600. Greedy ids
must be equal except where the reference's top two are within twice the bound.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model import weight_update
from tandem.runtime.model.quant import gguf_blocks
from tandem.runtime.model.quant.gguf_load import GgufLinear, quantized_names
from tandem.runtime.model.quant.gptq_awq import Int4Format, _as_q4_1, convert, parse, to_gguf_rows
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

from quant_checkpoints import fp32_runner, prefill_logprobs, save_pair

pytestmark = pytest.mark.timeout(600)

SHIFT_FRACTION = {"q4_0": 1 / 1024, "q4_1": 1 / 32}  # the logprob bound, a fraction of the int4 rounding's
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack: nibble i of a word <- column order[i] of its 8
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [400, 9000, 77, 12345, 31, 2024], [5] * 12]
# (name, quantization_config) of each kind served
KINDS = {
    "gptq_sym_v1_g128": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    "gptq_asym_v1_g32": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False},
    "gptq_asym_v2_g64_act_order": {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False,
                                   "desc_act": True, "checkpoint_format": "gptq_v2"},
    "awq_g64": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
}


def _quantize(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor):
    """Round-to-nearest int4 of W [N, K] by groups g_idx [K]: (q [N, K], zeros [G, N], scales fp16 [G, N])."""
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(groups, w.shape[0], dtype=torch.float16), torch.empty(groups, w.shape[0])
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        if sym:
            scales[g], zeros[g] = (cols.abs().amax(1) / 7).half(), 8
        else:
            lo, hi = cols.amin(1).clamp_max(0), cols.amax(1).clamp_min(0)
            scales[g] = ((hi - lo) / 15).half()
            zeros[g] = (-lo / scales[g].float()).round().clamp(1, 15)  # v1 cannot store a zero of 0
    s, z = scales.float()[g_idx].t(), zeros[g_idx].t()
    q = (w / s + z).round().clamp(0, 15)
    return q.to(torch.int64), zeros.to(torch.int64), scales


def _pack_gptq_rows(q_kn: np.ndarray) -> np.ndarray:
    """AutoGPTQ's qweight: word [i, n] |= q[8i + j, n] << 4j."""
    out = np.zeros((q_kn.shape[0] // 8, q_kn.shape[1]), dtype=np.uint32)
    for i in range(out.shape[0]):
        for j in range(8):
            out[i] |= q_kn[8 * i + j].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def _pack_columns(v: np.ndarray, order: list[int]) -> np.ndarray:
    """[R, C] -> [R, C/8]: word [r, c] |= v[r, 8c + order[j]] << 4j (GPTQ's qzeros: order 0..7; AWQ's order)."""
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for c in range(out.shape[1]):
        for j in range(8):
            out[:, c] |= v[:, 8 * c + order[j]].astype(np.uint32) << np.uint32(4 * j)
    return out.view(np.int32)


def _quantized_linear(w: torch.Tensor, qc: dict, g_idx: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """One linear in the checkpoint's tensors, and its dequantized float32 weight."""
    q, zeros, scales = _quantize(w, qc["group_size"], qc.get("sym", False), g_idx)
    ref = (scales.float()[g_idx].t() * (q - zeros[g_idx].t()).float()).contiguous()
    if qc["quant_method"] == "awq":
        tensors = {"qweight": _pack_columns(q.t().numpy(), AWQ_ORDER),
                   "qzeros": _pack_columns(zeros.numpy(), AWQ_ORDER)}
    else:
        stored = zeros - (0 if qc.get("checkpoint_format") == "gptq_v2" else 1)
        tensors = {"qweight": _pack_gptq_rows(q.t().numpy()), "qzeros": _pack_columns(stored.numpy(), list(range(8))),
                   "g_idx": g_idx.to(torch.int32)}
    return {k: torch.as_tensor(v) for k, v in tensors.items()} | {"scales": scales}, ref


def _g_idx(k: int, qc: dict) -> torch.Tensor:
    """k // group, or with desc_act the groups dealt to 32-input blocks in a shuffled order (an
    act-order g_idx that keeps each block in one group)."""
    g = torch.arange(k) // qc["group_size"]
    if not qc.get("desc_act"):
        return g
    blocks = g.view(-1, 32)[:, 0]
    return blocks[torch.randperm(len(blocks), generator=torch.Generator().manual_seed(1))].repeat_interleave(32)


def write_checkpoints(src: Path, root: Path, name: str, qc: dict, g_idx_of=None) -> tuple[Path, Path]:
    """`src`'s linears quantized: (the quantized checkpoint, the plain one with the dequantized weights).
    `g_idx_of(k, qc)`: the inputs' groups (default _g_idx)."""
    from safetensors.torch import load_file

    quant, plain = root / name, root / f"{name}_reference"
    weights = load_file(str(src / "model.safetensors"))
    qweights, refs = {}, {}
    for key, w in weights.items():
        if key.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS:
            tensors, ref = _quantized_linear(w.float(), qc, (g_idx_of or _g_idx)(w.shape[1], qc))
            qweights |= {f"{key.removesuffix('weight')}{k}": v for k, v in tensors.items()}
            refs[key] = ref
        else:
            qweights[key] = refs[key] = w
    return save_pair(src, quant, plain, qweights, refs, qc)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tandem.launch.make_tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("int4")
    src = build_tiny_model(root / "src", arch="llama", hidden=128, layers=2, heads=4, kv_heads=2)
    return {name: write_checkpoints(src, root, name, qc) for name, qc in KINDS.items()} | {"unquantized": (src, src)}




@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_are_the_checkpoint_weights(checkpoints, kind):
    """gguf's own dequantizer reads the converted rows back: Q4_0 exactly, Q4_1 within m's rounding."""
    from safetensors.torch import load_file

    quant, plain = checkpoints[kind]
    tensors, refs = load_file(str(quant / "model.safetensors")), load_file(str(plain / "model.safetensors"))
    fmt = parse(KINDS[kind])
    for proj in ("self_attn.k_proj", "mlp.down_proj"):
        prefix = f"model.layers.1.{proj}"
        parts = (tensors.get(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx"))
        rows, ggml_type = to_gguf_rows(fmt, *parts)
        got = torch.from_numpy(gguf_blocks.dequantize_raw(rows.numpy(), ggml_type))
        want = refs[f"{prefix}.weight"]
        if KINDS[kind].get("sym"):
            assert gguf_blocks.TYPES[ggml_type][0] == "q4_0" and torch.equal(got, want)
            continue
        assert gguf_blocks.TYPES[ggml_type][0] == "q4_1"
        # |m + s z| <= 2^-11 |s z| <= 2^-11 * 16 s, and d u + m rounded once in float32
        s = tensors[f"{prefix}.scales"].float().amax()
        assert (got - want).abs().max() <= 16 * s * 2 ** -11 + 2 ** -23 * want.abs().max()
        assert not torch.equal(got, want)  # m's rounding shows: the bound is not vacuous here


@pytest.mark.parametrize("kind", list(KINDS))
def test_served_quantized_against_the_dequantized_reference(checkpoints, kind):
    quant, plain = checkpoints[kind]
    ref, ours, unquantized = fp32_runner(plain), fp32_runner(quant), fp32_runner(checkpoints["unquantized"][0])
    layer = ours.model.layers[0]  # unset --quantization: detected from quantization_config
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    qtype = "q4_0" if KINDS[kind].get("sym") else "q4_1"
    assert all(isinstance(m, GgufLinear) and m.weight.qtype == qtype for m in linears)
    fused = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    # every layer's linears, not the embedding (nor a head)
    assert quantized_names(ours.model) == {f"layers.{i}.{m}.weight" for i in range(2) for m in fused}
    label = f"{KINDS[kind]['quant_method']}:{qtype}"
    assert ours.weight_info()["weight_quantization"] == label  # the checkpoint's method, then the blocks served
    with pytest.raises(ValueError, match=f"holds this weight quantized \\({label}\\)"):
        weight_update.check(ours.model, ours.config, ours.tp,
                            [("model.layers.0.mlp.down_proj.weight", torch.zeros(ours.model.layers[0].mlp.down_proj.weight.shape))])
    worst, shift, steps = 0.0, 0.0, []
    for ids in PROMPTS:
        want = BareLoop(ref).generate([ids], 12).output_ids[0]
        got = BareLoop(ours).generate([ids], 12).output_ids[0]
        lp_ref = prefill_logprobs(ref, ids + want)
        worst = max(worst, (prefill_logprobs(ours, ids + want) - lp_ref).abs().max().item())
        shift = max(shift, (prefill_logprobs(unquantized, ids + want) - lp_ref).abs().max().item())
        if got != want:
            step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            steps.append(lp_ref[len(ids) - 1 + step].topk(2).values)
    bound = SHIFT_FRACTION[qtype] * shift
    print(f"{kind}: max |logprob - reference| {worst:.2e}, the int4 rounding's {shift:.2e} (1/{shift / worst:.0f})")
    assert worst <= bound, (worst, shift)
    assert all((top2[0] - top2[1]).item() < 2 * bound for top2 in steps)


def test_bf16_on_amx_symmetric_gptq_is_the_dequantized_bf16_path_bit_for_bit(checkpoints):
    """Q4_0 holds the checkpoint's weights exactly, and bf16 activations on AMX-BF16 dequantize them
    to the bf16 the plain checkpoint holds, summed as its linear sums them."""
    from tandem.kernels.cpu_ops import load_cpu_ops

    if not load_cpu_ops().gguf_isa().startswith("amx_bf16"):
        pytest.skip("this CPU (or kernel) gives no AMX-BF16 to the process: bf16 takes the integer arithmetic")
    quant, plain = checkpoints["gptq_sym_v1_g128"]
    args = {"max_total_tokens": 512, "max_running_requests": 4, "dtype": "bfloat16"}
    ref = BareLoop(ModelRunner(ServerArgs(model_path=str(plain), **args))).generate(PROMPTS, 8, keep_logits=True)
    ours = BareLoop(ModelRunner(ServerArgs(model_path=str(quant), **args))).generate(PROMPTS, 8, keep_logits=True)
    assert ours.output_ids == ref.output_ids
    assert all(torch.equal(a, b) for a, b in zip(ours.step_logits, ref.step_logits))


def test_a_row_gets_the_same_logits_alone_and_batched(checkpoints):
    loop = BareLoop(fp32_runner(checkpoints["awq_g64"][0]))
    batched = loop.generate(PROMPTS, 6, keep_logits=True)
    for i, ids in enumerate(PROMPTS):
        alone = loop.generate([ids], 6, keep_logits=True)
        assert alone.output_ids[0] == batched.output_ids[i]
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone.step_logits, batched.step_logits))


def test_quantization_none_is_the_reference_bit_for_bit(checkpoints):
    quant, plain = checkpoints["gptq_asym_v1_g32"]
    ref, ours = fp32_runner(plain), fp32_runner(quant, "none")
    assert not any(isinstance(m, GgufLinear) for m in ours.model.modules())
    ids = PROMPTS[1]
    assert torch.equal(prefill_logprobs(ours, ids), prefill_logprobs(ref, ids))


def test_fused_parts_of_two_types_become_q4_1_exactly():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    sym_q, _, sym_s = _quantize(w, 32, True, torch.arange(64) // 32)
    fmt = Int4Format("gptq", 32, 0)
    zeros8 = torch.full((2, 16), 8, dtype=torch.int64)
    parts = {"qweight": torch.as_tensor(_pack_gptq_rows(sym_q.t().numpy())),
             "qzeros": torch.as_tensor(_pack_columns(zeros8.numpy(), list(range(8)))), "scales": sym_s}
    rows, ggml_type = to_gguf_rows(fmt, **parts)
    assert ggml_type == gguf_blocks.TYPE_IDS["q4_0"]
    as_q4_1 = _as_q4_1(rows)
    assert np.array_equal(gguf_blocks.dequantize_raw(as_q4_1.numpy(), gguf_blocks.TYPE_IDS["q4_1"]),
                          gguf_blocks.dequantize_raw(rows.numpy(), ggml_type))
    # in a checkpoint: q_proj symmetric-looking (all zeros 8), k/v not -> all three Q4_1
    asym = dict(parts, qzeros=torch.as_tensor(_pack_columns(np.full((2, 16), 7), list(range(8)))))
    weights = {f"model.layers.0.self_attn.{p}.{k}": v
               for p, src in (("q_proj", parts), ("k_proj", asym), ("v_proj", asym)) for k, v in src.items()}
    plan = convert(weights, fmt, keep=True)
    assert set(plan.types.values()) == {gguf_blocks.TYPE_IDS["q4_1"]}
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (16, 2 * 20)


@pytest.mark.parametrize("change, field", [
    ({"bits": 8}, "quantization_config.bits 8"),
    ({"quant_method": "fp8"}, "quantization_config.quant_method 'fp8' is not served; tandem serves gptq, awq"),
    ({"group_size": 16}, "quantization_config.group_size 16"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format 'marlin'"),
    ({"lm_head": True}, "quantization_config.lm_head"),
])
def test_unserved_configs_are_refused_naming_the_field(checkpoints, tmp_path, change, field):
    quant, _ = checkpoints["gptq_asym_v1_g32"]
    bad = tmp_path / "bad"
    shutil.copytree(quant, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] |= change
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"config.json: config.json {field}".replace("(", r"\(")):
        fp32_runner(bad)


def test_awq_version_and_a_real_act_order_permutation_are_refused():
    with pytest.raises(ValueError, match="quantization_config.version 'gemv'"):
        parse(KINDS["awq_g64"] | {"version": "gemv"})
    fmt = parse(KINDS["gptq_asym_v2_g64_act_order"])
    w = torch.randn(16, 128)
    g_idx = (torch.randperm(128, generator=torch.Generator().manual_seed(0)) // 64)  # inputs dealt one by one
    tensors, _ = _quantized_linear(w, KINDS["gptq_asym_v2_g64_act_order"] | {"desc_act": False}, g_idx)
    with pytest.raises(ValueError, match=r"lin.g_idx: an act-order \(desc_act\) permutation"):
        to_gguf_rows(fmt, tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx, name="lin")


def test_a_real_act_order_checkpoint_is_refused_and_served_dequantized_by_none(checkpoints, tmp_path):
    """Inputs dealt to groups one by one (GPTQ's desc_act order): no 32-input block has one scale."""
    def dealt(k: int, qc: dict) -> torch.Tensor:
        return torch.randperm(k, generator=torch.Generator().manual_seed(k)) // qc["group_size"]

    qc = KINDS["gptq_asym_v2_g64_act_order"]
    quant, plain = write_checkpoints(checkpoints["unquantized"][0], tmp_path, "dealt", qc, dealt)
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.\S+_proj\.g_idx: an act-order \(desc_act\)"):
        fp32_runner(quant)
    assert torch.equal(prefill_logprobs(fp32_runner(quant, "none"), PROMPTS[0]), prefill_logprobs(fp32_runner(plain), PROMPTS[0]))


def test_quantization_flag_must_match_the_checkpoint(checkpoints, tiny_model_dir):
    quant, _ = checkpoints["awq_g64"]
    with pytest.raises(ValueError, match="--quantization gptq: .* is a awq checkpoint"):
        fp32_runner(quant, "gptq")
    with pytest.raises(ValueError, match="--quantization awq: .* declares no quantization_config"):
        fp32_runner(Path(tiny_model_dir("llama")), "awq")
    with pytest.raises(ValueError, match="--quantization awq serves its weights through tandem's own classes"):
        ModelRunner(ServerArgs(model_path=str(quant), max_total_tokens=512, max_running_requests=4, dtype="float32",
                               quantization="awq", model_impl="transformers"))
    from tandem.runtime.model_files import default_model_path

    with pytest.raises(ValueError, match="--quantization gptq: .*gguf declares no quantization_config"):
        fp32_runner(Path(default_model_path()), "gptq")
    with pytest.raises(ValueError, match="--quantization: 'bitsandbytes' is not served; tandem serves gguf .* "
                                         "gptq, awq .* w8a8_int8"):
        ServerArgs(model_path=str(quant), quantization="bitsandbytes")

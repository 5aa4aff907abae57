"""SGLang's w8a8_int8 (runtime/model/quant/w8a8_int8.py): per-channel int8 weights, per-token dynamic
int8 activations. A tiny checkpoint written here in the format's tensors (`weight` int8 [N, K],
`weight_scale` float32 [N, 1], quantization_config quant_method w8a8_int8), served against a plain
float32 checkpoint of the same dequantized weights q * s.

The bound: the int8 sums are exact, so the op equals the float64 product of the quantized operands
up to float32's two scale multiplications (3 * 2^-24 relative). Against the dequantized weights the
only difference is the activations' rounding, at most max|x| / 254 per input: the same relative size
as the weights' own int8 rounding (max|w| / 254 per weight), so served logprobs move from the
reference's by about as much as the int8 weight rounding moved them from the unquantized model's
(`shift`); activations have heavier tails than these random weights, so the bound is 4 * shift.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.quant.w8a8_int8 import Int8Linear, Int8Weight, linear, quantize_rows

from quant_checkpoints import fp32_runner, prefill_logprobs, save_pair

pytestmark = pytest.mark.timeout(600)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [400, 9000, 77, 12345, 31, 2024], [5] * 12]
SHIFT_FACTOR = 4


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(dim=1, keepdim=True) / 127
    return (w.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def _write(src: Path, root: Path) -> tuple[Path, Path]:
    from safetensors.torch import load_file

    quant, plain = root / "w8a8", root / "w8a8_reference"
    weights = load_file(str(src / "model.safetensors"))
    qweights, refs = {}, {}
    for key, w in weights.items():
        if key.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS:
            q, scale = _quantize(w)
            qweights[key], qweights[key.replace(".weight", ".weight_scale")] = q, scale
            refs[key] = q.float() * scale
        else:
            qweights[key] = refs[key] = w
    qc = {"quant_method": "w8a8_int8", "activation_scheme": "dynamic"}
    return save_pair(src, quant, plain, qweights, refs, qc)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tandem.launch.make_tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("int8")
    src = build_tiny_model(root / "src", arch="llama", hidden=128, layers=2, heads=4, kv_heads=2)
    return (src, *_write(src, root))




def _weight(n: int, k: int) -> tuple[Int8Weight, torch.Tensor, torch.Tensor]:
    q, scale = _quantize(torch.randn(n, k))
    return Int8Weight(q.t().contiguous(), scale.view(1, -1), torch.zeros(()).expand(n, k)), q, scale


def test_the_op_is_the_exact_integer_product_scaled():
    torch.manual_seed(0)
    weight, q, scale = _weight(48, 96)
    x = torch.randn(7, 96) * torch.logspace(-2, 1, 7)[:, None]
    xq, s_x = quantize_rows(x)
    assert xq.abs().max() == 127 and torch.all((x / s_x - xq.float()).abs() <= 0.5 + 1e-6)
    want = (xq.double() @ q.double().t()) * s_x.double() * scale.double().t()
    got = linear(x, weight)
    assert torch.all((got.double() - want).abs() <= 3 * 2 ** -24 * want.abs())
    bias = torch.randn(48)
    assert torch.equal(linear(x, weight, bias), (got + bias).float())
    assert linear(x.view(7, 1, 96), weight).shape == (7, 1, 48)


def test_a_row_is_the_same_alone_and_batched():
    torch.manual_seed(1)
    weight, _, _ = _weight(64, 128)
    x = torch.randn(33, 128, dtype=torch.bfloat16)
    batched = linear(x, weight)
    assert batched.dtype == torch.bfloat16
    assert all(torch.equal(linear(x[i:i + 1], weight)[0], batched[i]) for i in range(33))


def test_served_int8_against_the_dequantized_reference(checkpoints):
    src, quant, plain = checkpoints
    ref, ours, unquantized = fp32_runner(plain), fp32_runner(quant), fp32_runner(src)  # detected from quantization_config
    layer = ours.model.layers[1]
    assert all(isinstance(m, Int8Linear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert layer.self_attn.qkv_proj.weight.shape == (128 + 2 * 64, 128)
    info, ref_info = ours.weight_info(), ref.weight_info()
    assert (info["weight_quantization"], ref_info["weight_quantization"]) == ("w8a8_int8", "none")
    from tandem.runtime.model import weight_update

    with pytest.raises(ValueError, match=r"q_proj.weight: the model holds this weight quantized \(w8a8_int8\)"):
        weight_update.check(ours.model, ours.config, ours.tp, [("model.layers.1.self_attn.q_proj.weight", torch.zeros(128, 128))])
    worst, shift, steps = 0.0, 0.0, []
    for ids in PROMPTS:
        want = BareLoop(ref).generate([ids], 12).output_ids[0]
        got = BareLoop(ours).generate([ids], 12).output_ids[0]  # decode runs the modules (no C++ step)
        lp_ref = prefill_logprobs(ref, ids + want)
        worst = max(worst, (prefill_logprobs(ours, ids + want) - lp_ref).abs().max().item())
        shift = max(shift, (prefill_logprobs(unquantized, ids + want) - lp_ref).abs().max().item())
        if got != want:
            step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            steps.append(lp_ref[len(ids) - 1 + step].topk(2).values)
    print(f"w8a8_int8: max |logprob - reference| {worst:.2e}, the int8 weight rounding's {shift:.2e}")
    assert worst <= SHIFT_FACTOR * shift, (worst, shift)
    assert all((top2[0] - top2[1]).item() < 2 * SHIFT_FACTOR * shift for top2 in steps)
    assert ref.model._decode_step is not None and ours.model._decode_step is None  # the C++ step: plain weights only


def test_quantization_none_is_the_reference_bit_for_bit(checkpoints):
    _, quant, plain = checkpoints
    ours, ref = fp32_runner(quant, "none"), fp32_runner(plain)
    assert not any(isinstance(m, Int8Linear) for m in ours.model.modules())
    assert torch.equal(prefill_logprobs(ours, PROMPTS[0]), prefill_logprobs(ref, PROMPTS[0]))


def test_refusals_name_what_is_wrong(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src, quant, _ = checkpoints
    with pytest.raises(ValueError, match="--quantization w8a8_int8: .* declares no quantization_config"):
        fp32_runner(src, "w8a8_int8")
    with pytest.raises(ValueError, match="--quantization gptq: .* is a w8a8_int8 checkpoint"):
        fp32_runner(quant, "gptq")
    bad = tmp_path / "bad"
    shutil.copytree(quant, bad)
    weights = load_file(str(bad / "model.safetensors"))
    del weights["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight: an int8 weight without weight_scale"):
        fp32_runner(bad)

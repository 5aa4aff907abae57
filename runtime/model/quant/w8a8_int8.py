"""SGLang's w8a8_int8 checkpoints (`--quantization w8a8_int8`, or config.json's quantization_config
quant_method "w8a8_int8"): per-output-channel symmetric int8 weights (`weight` int8 [N, K],
`weight_scale` [N] or [N, 1] float) with per-token dynamic int8 activations.

Arithmetic of a row x (`linear`): s_x = max|x| / 127 in float32, x_q = round(x / s_x) in -127..127;
the int8 products summed exactly in int32 (torch._int_mm); y = float32(acc) * s_x * s_w (+ bias), then
x's dtype. The sums are exact and everything else is per element, so a row's bits never depend on
the batch or the thread count. Error against the float weights' product: the activation rounding,
at most s_x / 2 = max|x| / 254 per input, and the weights' own rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.runtime.model.quant import FUSED_PARTS, siblings

METHOD = "w8a8_int8"


@dataclass(frozen=True)
class Int8Format:
    """A w8a8_int8 checkpoint (its quantization_config has nothing else tandem reads)."""
    method: str = METHOD


@dataclass(frozen=True, eq=False)
class Int8Weight:
    """An [out, in] int8 weight held transposed ([in, out], torch._int_mm's right operand) with its
    per-output scales; `like` a zero-storage [out, in] view giving the shape."""
    packed: torch.Tensor
    scale: torch.Tensor
    like: torch.Tensor
    qtype: str = "w8a8_int8"

    @property
    def shape(self) -> torch.Size:
        return self.like.shape


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], float32 scales [M, 1]): per-token symmetric, max|x| -> 127."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 127
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) in x's dtype, with x quantized per row to int8 (the module doc's arithmetic)."""
    n, k = weight.shape
    q, s_x = quantize_rows(x.reshape(-1, k))
    y = torch._int_mm(q, weight.packed).float() * s_x * weight.scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], n)


class Int8Linear(nn.Module):
    """A linear on an int8 weight, activations quantized per token (`linear`)."""
    cpu_decode_step = False  # the C++ decode step (cpu_decode_step.py) takes no int8 weights

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@dataclass
class Int8Plan:
    """The int8 weights' scales by Hugging Face name; `take` pairs them with the fused weights."""
    scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def take(self, weights: dict[str, torch.Tensor]) -> dict[str, Int8Weight]:
        """Pops the int8 weights out of `weights` (the loader's fused names) with their scales."""
        held = {}
        for name in [n for n, t in weights.items() if t.dtype == torch.int8]:
            w = weights.pop(name)
            scale = torch.cat([self.scales[part] for part in _parts(name)]).float()
            held[name] = Int8Weight(w.t().contiguous(), scale.view(1, -1),
                                    torch.zeros((), dtype=torch.float32).expand(*w.shape))
        return held


def _parts(fused_name: str) -> list[str]:
    """The Hugging Face weight names a fused weight (loader's names) was concatenated from, in order."""
    module, _, attr = fused_name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    root = [] if fused_name.startswith("lm_head.") else ["model"]
    return [".".join([*root, *([parent] if parent else []), p, attr]) for p in FUSED_PARTS.get(proj, (proj,))]


def convert(weights: dict[str, torch.Tensor], keep: bool) -> Int8Plan:
    """Takes every `X.weight_scale` out of `weights` (Hugging Face names): kept by the plan where
    `keep` and the whole fused linear is int8, else `X.weight` dequantized to float32 (q * s, one rounding)."""
    plan = Int8Plan()
    prefixes = [n.removesuffix(".weight_scale") for n in weights if n.endswith(".weight_scale")]
    for prefix in prefixes:
        scale, w = weights.pop(f"{prefix}.weight_scale").float().flatten(), weights.get(f"{prefix}.weight")
        if w is None or w.dtype != torch.int8 or w.dim() != 2 or scale.numel() != w.shape[0]:
            raise ValueError(f"{prefix}: weight_scale {scale.numel()} per-channel scales need an int8 [out, in] "
                             f"weight, got {None if w is None else (w.dtype, tuple(w.shape))}")
        if keep and all(p in prefixes for p in siblings(prefix)):
            plan.scales[f"{prefix}.weight"] = scale
        else:
            weights[f"{prefix}.weight"] = w.float() * scale[:, None]
    stray = [n for n, t in weights.items() if t.dtype == torch.int8 and n.removesuffix(".weight") not in prefixes]
    if stray:
        raise ValueError(f"{stray[0]}: an int8 weight without weight_scale")
    return plan


def install(model: nn.Module, held: dict[str, Int8Weight]) -> None:
    """Puts the int8 weights in place of their nn.Linear modules (after the loader set the rest)."""
    for name, weight in held.items():
        module_name, _, attr = name.rpartition(".")
        parent_name, _, child = module_name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr != "weight" or not isinstance(module, nn.Linear):
            raise ValueError(f"{name}: only linear weights are held as int8")
        setattr(model.get_submodule(parent_name), child, Int8Linear(weight, module.bias))


def held_as(model: nn.Module) -> str | None:
    """"w8a8_int8" where the model's linears hold int8 weights (what /server_info reports), else None."""
    return METHOD if any(isinstance(m, Int8Linear) for m in model.modules()) else None

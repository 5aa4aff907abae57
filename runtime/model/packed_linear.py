"""Linear layers whose weights oneDNN keeps in its own blocked layout: bfloat16 on CPUs with
AMX-BF16 or AVX512-BF16.

torch's bf16 linear hands oneDNN an [out, in] weight that its AMX kernels re-block on every call;
blocked once at load, a decode step's matmuls run ~1.5x faster (prefill ~1.2x) on the same
kernels, so the outputs are bit-identical. float32 keeps torch's MKL path: packing measured
slower there at batch 1 and in prefill.

Invariant: a packed weight is an opaque oneDNN tensor that only `linear` reads; nothing else
(loader, tensor parallel sharding, the embedding) ever sees it.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.kernels.cpu_ops import cpu_flags
from tandem.runtime.envs import envs


def packs_weights(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether linears of `dtype` on `device` run on packed weights (TANDEM_CPU_PACK_WEIGHTS=0: never)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and envs.CPU_PACK_WEIGHTS.get()
            and torch.backends.mkldnn.is_available() and bool(cpu_flags() & {"amx_bf16", "avx512_bf16"}))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> oneDNN's blocked layout (no batch-size hint: one layout serves every batch)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), the weight plain or packed."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = pack(weight)  # keeps the [out, in] shape
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear under `model` by a PackedLinear; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child.weight, child.bias))
                count += 1
    return count

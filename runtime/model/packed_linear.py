"""Linear layers on weights packed once at load into the layout the CPU GEMM library computes
from: bfloat16 in oneDNN's blocked layout on CPUs with AMX-BF16 or AVX512-BF16, float32 in MKL's
packed-GEMM layout where torch has MKL.

torch's plain linear hands the library an [out, in] weight that it re-packs on every call:
- bf16: oneDNN's AMX kernels re-block it; blocked once, a decode step's matmuls run ~1.5x faster
  (prefill ~1.2x) on the same kernels, so outputs are bit-identical.
- fp32: MKL's sgemm copies it into panels; packed once (`cblas_sgemm_pack`, run by
  `cblas_sgemm_compute`), a batch-64 decode step's matmuls run ~1.3x faster, batch 8 ~1.6x,
  a 2048-row prefill chunk the same. Same FMA count, other summation blocking: results match
  the plain linear to float rounding, not bit for bit.

Invariant: a packed weight is opaque to everything but `linear`; nothing else (loader, tensor
parallel sharding, the embedding) ever sees it, and the plain weight is not kept beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.kernels.cpu_ops import cpu_flags
from tandem.runtime.envs import envs

# MKL's packed B matrix holds B alone: the rows of A only steer the threading plan stored with it
# (CTranslate2 packs with m=1 and computes at any m). Planned for 512 rows, the pack ran within
# 3% of a pack made for the exact row count at 8, 32, 64 and 128 rows, and as fast as the plain
# sgemm at 2048; planned for 1 row it lost most of the gain at 8 and 64.
_MKL_PLAN_ROWS = 512


@dataclass(frozen=True)
class MklPackedWeight:
    """A float32 [out, in] weight in MKL's packed layout. `like` is a zero-storage [out, in] view
    that gives MKL's call the shape and dtype (it reads no element of it)."""
    packed: torch.Tensor
    like: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.like.shape


Weight = torch.Tensor | MklPackedWeight


def packs_weights(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether linears of `dtype` on `device` run on packed weights (TANDEM_CPU_PACK_WEIGHTS=0: never)."""
    if torch.device(device).type != "cpu" or not envs.CPU_PACK_WEIGHTS.get():
        return False
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})
    if dtype == torch.float32:  # the packed weight lives in an MKL-DNN tensor
        return torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
    return False


def pack(weight: torch.Tensor) -> Weight:
    """weight [out, in] -> the packed layout of its dtype (one layout serves every batch size)."""
    weight = weight.detach().contiguous()
    if weight.dtype == torch.float32:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_PLAN_ROWS)
        return MklPackedWeight(packed, torch.zeros((), dtype=weight.dtype).expand(weight.shape))
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), the weight plain or packed."""
    if isinstance(weight, MklPackedWeight):
        # the last argument is the row count MKL's packed path runs for; any other count would
        # send torch to its plain fallback, which would read `like`
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        return torch.ops.mkl._mkl_linear(x, weight.packed, weight.like, bias, rows)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = pack(weight)
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

"""Linear layers on weights packed once at load into the layout the CPU GEMM library computes
from: bfloat16 in oneDNN's blocked layout on CPUs with AMX-BF16 or AVX512-BF16; float32 in
MKL's packed-GEMM layout on Intel CPUs, oneDNN's blocked layout on others.

torch's plain linear hands the library an [out, in] weight that it re-packs on every call:
- bf16: oneDNN's AMX kernels re-block it; blocked once, a decode step's matmuls run ~1.5x faster
  (prefill ~1.2x) on the same kernels, so outputs are bit-identical.
- fp32: torch's plain linear is MKL's sgemm, which copies the weight into panels on every call.
  Packed once (`cblas_sgemm_pack`), a batch-64 decode step's matmuls ran ~1.3x faster on an
  Intel Xeon. On an AMD EPYC, MKL (packed or not) ran 2.3-3.6x slower than oneDNN's fp32 kernels
  on the same blocked layout as bf16 (MKL takes slower paths on CPUs that are not Intel's), so
  the layout follows the CPU's vendor (`fp32_layout`). A rule, not a timing: the two sum in other
  orders, so the layout decides the last bits of every answer and must not change from start to
  start. Same FMA count, other summation blocking: results match the plain linear to float
  rounding, not bit for bit.

Invariant: a packed weight is opaque to everything but `linear`; nothing else (loader, tensor
parallel sharding, the embedding) ever sees it, and the plain weight is not kept beside it.
Packed linears hand oneDNN only row counts from `padded_rows`, which bounds the kernels it
compiles and keeps.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.kernels.cpu_ops import cpu_flags
from tandem.runtime.envs import envs
from tandem.runtime.model.quant import gguf_blocks
from tandem.runtime.model.quant.gguf_blocks import GgufWeight

# MKL's packed B matrix holds B alone: the rows of A only steer the threading plan stored with it
# (CTranslate2 packs with m=1 and computes at any m). Planned for 512 rows, the pack ran within
# 3% of a pack made for the exact row count at 8, 32, 64 and 128 rows, and as fast as the plain
# sgemm at 2048; planned for 1 row it lost most of the gain at 8 and 64.
_MKL_PLAN_ROWS = 512
# oneDNN compiles a kernel for every input row count it meets and keeps it in two caches (torch's
# ideep LRU and its own, 1024 entries each), ~1 MB of the process a kernel. Decode batches recur,
# but prefill chunks bring a new row count almost every step: a one-minute soak grew a server by
# 0.5 GB. Past EXACT_ROWS the rows are padded to one of PADS_PER_OCTAVE sizes per power of two
# (at most 1/16 more rows; ~3% more linear time on prefill chunks, measured on 2 AMD EPYC cores).
EXACT_ROWS = 64
PADS_PER_OCTAVE = 16  # at most EXACT_ROWS: the step of the first padded octave must be >= 1
# oneDNN's fp32 kernel for a single row sums over K in another order than its GEMM for two or
# more (seen at K=1536 with AVX-512), so a lone row would get other bits than the same row in a
# batch: one row is computed as two. Its cost is nil (a one-row linear is bound by the weight's bytes).
MIN_ROWS = 2


@dataclass(frozen=True)
class MklPackedWeight:
    """A float32 [out, in] weight in MKL's packed layout. `like` is a zero-storage [out, in] view
    that gives MKL's call the shape and dtype (it reads no element of it)."""
    packed: torch.Tensor
    like: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.like.shape


@dataclass(frozen=True)
class AmxPackedWeight:
    """A bfloat16 [out, in] weight in the AMX tile layout of kernels/csrc/amx_linear_cpu.cpp
    ([out/16, in/32, 16, 32]), whose linear gives a row the same bits among any rows. `like` is a
    zero-storage [out, in] view for the weight's shape."""
    packed: torch.Tensor
    like: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.like.shape


Weight = torch.Tensor | MklPackedWeight | AmxPackedWeight | GgufWeight


def weight_and_like(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight as tensors for a C++ op (kernels/csrc/decode_layers_cpu.cpp's `linear`): a packed
    buffer and its `like` (MKL's is 2-D, AMX's 4-D, GGUF's uint8 blocks), or the tensor itself and None."""
    return ((weight.packed, weight.like) if isinstance(weight, (MklPackedWeight, AmxPackedWeight, GgufWeight))
            else (weight, None))


def amx_ops() -> object | None:
    """The C++ ops where they hold AMX's batch-invariant bf16 linear on this CPU, else None."""
    from tandem.kernels.cpu_ops import load_cpu_ops

    if "amx_bf16" not in cpu_flags() or not envs.CPU_AMX_LINEAR.get():
        return None
    ops = load_cpu_ops()
    return ops if ops is not None and ops.amx_available() else None


def _amx_pack(weight: torch.Tensor) -> AmxPackedWeight | None:
    """A contiguous bf16 weight in the AMX kernel's layout, or None where the kernel cannot take it."""
    fits = weight.dtype == torch.bfloat16 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
    ops = amx_ops() if fits else None
    return None if ops is None else AmxPackedWeight(ops.amx_pack(weight), _like(weight))


def _like(weight: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=weight.dtype).expand(weight.shape)


def _loaded_ops() -> object:
    """The C++ ops an AmxPackedWeight was packed by (loaded then, cached since): no check per call."""
    from tandem.kernels.cpu_ops import load_cpu_ops

    return load_cpu_ops()


def packs_weights(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether linears of `dtype` on `device` run on packed weights (TANDEM_CPU_PACK_WEIGHTS=0: never)."""
    if torch.device(device).type != "cpu" or not envs.CPU_PACK_WEIGHTS.get():
        return False
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})
    if dtype == torch.float32:  # both layouts live in MKL-DNN tensors; oneDNN's is taken only
        # where it measured faster than MKL's, so a torch without MKL keeps the plain linear
        return torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
    return False


def pack(weight: torch.Tensor, fp32_as: str | None = None) -> Weight:
    """weight [out, in] -> the packed layout of its dtype (one layout serves every batch size).
    fp32 goes to `fp32_as` ("mkl" or "onednn"), by default the faster here (`fp32_layout`)."""
    if fp32_as not in (None, "mkl", "onednn"):
        raise ValueError(f"fp32_as must be 'mkl' or 'onednn', got {fp32_as!r}")
    weight = weight.detach().contiguous()
    if (amx := _amx_pack(weight)) is not None:
        return amx
    if weight.dtype == torch.float32 and (fp32_as or fp32_layout()[0]) == "mkl":
        return MklPackedWeight(torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_PLAN_ROWS), _like(weight))
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def fp32_layout() -> tuple[str, str]:
    """Where fp32 weights are packed on this CPU, "mkl" (Intel's) or "onednn" (any other), and why
    (for the log)."""
    vendor = cpu_vendor()
    if vendor == "GenuineIntel":
        return "mkl", "an Intel CPU: MKL's packed sgemm"
    return "onednn", f"{vendor or 'an unknown vendor'}: MKL takes slow paths off Intel CPUs"


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.split(":", 1)[-1].strip()


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run`, after one untimed call (the GEMM library
    picks and caches its kernels on the first)."""
    with torch.inference_mode():
        run()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
    return best


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), the weight plain or packed."""
    if isinstance(weight, GgufWeight):
        return gguf_blocks.linear(x, weight, bias)
    if isinstance(weight, AmxPackedWeight):
        return _loaded_ops().amx_linear(x, weight.packed, bias)
    if isinstance(weight, MklPackedWeight):
        # the last argument is the row count MKL's packed path runs for; any other count would
        # send torch to its plain fallback, which would read `like`
        return torch.ops.mkl._mkl_linear(x, weight.packed, weight.like, bias, _rows(x))
    if weight.is_mkldnn:
        return _onednn_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.numel() else 0


def padded_rows(rows: int) -> int:
    """The row count oneDNN computes `rows` at: MIN_ROWS for one, exact up to EXACT_ROWS, else
    rounded up to a step of 1/PADS_PER_OCTAVE of the power of two below it."""
    if rows <= EXACT_ROWS:
        return max(rows, MIN_ROWS) if rows else 0
    step = (1 << (rows.bit_length() - 1)) // PADS_PER_OCTAVE
    return -(-rows // step) * step


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = _rows(x)
    padded = padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    # zero rows: rows are independent, so any finite value would do, and zeros never trap
    x_padded = nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x_padded, weight, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = pack(weight)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def fp32_head(weight: torch.Tensor) -> Weight:
    """An LM head's [vocab, hidden] weight held for `head_logits`, which gives fp32 logits that a
    row gets alike among any rows and at any thread count. A bf16 weight on a CPU with AMX stays
    bf16 (the AMX kernel sums in fp32 and keeps the fp32 sums: half the bytes a step reads);
    otherwise an fp32 copy in the packed fp32 layout of this CPU (`fp32_layout`): MKL's packed GEMM
    on Intel and oneDNN's GEMM from MIN_ROWS rows elsewhere keep a row's bits at any row count,
    which the plain fp32 linear (a gemv for one row) does not. Off Intel, MKL's packed GEMM does
    not: with its AVX2 code path a row of a 49152-wide head changed at 2 and 3 rows."""
    if isinstance(weight, GgufWeight):  # a quantized head stays quantized (gguf_blocks.linear's fp32 sums)
        return weight
    weight = weight.detach().contiguous()
    if (amx := _amx_pack(weight)) is not None:
        return amx
    weight = weight.to(torch.float32)
    if packs_weights(torch.float32, weight.device):
        return pack(weight)
    return weight


def head_logits(hidden: torch.Tensor, head: Weight) -> torch.Tensor:
    """fp32 logits from a head `fp32_head` made."""
    if isinstance(head, GgufWeight):
        return gguf_blocks.linear(hidden, head, out_fp32=True)
    if isinstance(head, AmxPackedWeight):
        return _loaded_ops().amx_linear(hidden.to(torch.bfloat16), head.packed, None, True)
    return linear(hidden.float(), head)


def pack_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear under `model` (but the children named in `skip`) by a PackedLinear;
    returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name not in skip:
                setattr(module, name, PackedLinear(child.weight, child.bias))
                count += 1
    return count

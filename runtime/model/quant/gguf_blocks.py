"""GGUF blocks (Q4_0, Q4_1, Q8_0) repacked once for kernels/csrc/gguf_linear_cpu.cpp, and the
weight object the model's linears, its embedding and the C++ decode step take.

Arithmetic (kernels/csrc/gguf_linear_cpu.cpp says it in full), by activation dtype, never by row count:
- bfloat16 on a CPU with AMX-BF16: each weight unit dequantized on the fly to bfloat16 (the
  dequantized path's weight, bit for bit) and multiplied by AMX-BF16 tiles, float32 sums over K in
  ascending order: the dequantized bf16 path's arithmetic (kernels/csrc/gguf_amx_bf16.h).
- otherwise (float32, float16, bfloat16 without AMX-BF16): activations quantized per 32-input block
  to 16 bits, dotted with the weight's integers exactly, each block's integer sum scaled and added
  in float32 in ascending block order; the weights used exactly as the file stores them.
Either way a row's bits never depend on the batch or the thread count.

Invariant: a packed weight is opaque to everything but this module and the C++ ops; its
`like` is a zero-storage [out, in] view that gives shape and the in-feature count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FEATURES, BLOCK = 16, 32  # a unit: 16 output features x 32 inputs
# ggml type id -> (name, block bytes in the file, unit bytes packed)
TYPES: dict[int, tuple[str, int, int]] = {2: ("q4_0", 18, 288), 3: ("q4_1", 20, 320), 8: ("q8_0", 34, 544)}
TYPE_IDS = {name: tid for tid, (name, _, _) in TYPES.items()}


@dataclass(frozen=True, eq=False)
class GgufWeight:
    """An [out, in] GGUF-quantized weight in the kernel's layout ([ceil(out/16), in/32, unit] uint8)."""
    packed: torch.Tensor
    like: torch.Tensor
    qtype: str

    @property
    def shape(self) -> torch.Size:
        return self.like.shape

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def supported(ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this ggml type and [out, in] shape can be held packed."""
    return int(ggml_type) in TYPES and len(shape) == 2 and shape[1] % BLOCK == 0


def pack(raw: torch.Tensor | np.ndarray, ggml_type: int) -> GgufWeight:
    """raw: the file's [out, in / 32 * block bytes] uint8 rows of one tensor (rows permuted or
    concatenated as the loader fuses them) -> the kernel's layout."""
    name, block_bytes, unit = TYPES[int(ggml_type)]
    raw = torch.as_tensor(np.ascontiguousarray(raw) if isinstance(raw, np.ndarray) else raw.contiguous())
    n, row_bytes = raw.shape
    if raw.dtype != torch.uint8 or row_bytes % block_bytes:
        raise ValueError(f"{name}: rows of {row_bytes} bytes are not {block_bytes}-byte blocks")
    kb = row_bytes // block_bytes
    nb = -(-n // FEATURES)
    padded = torch.zeros((nb * FEATURES, row_bytes), dtype=torch.uint8)
    padded[:n] = raw
    blocks = padded.view(nb, FEATURES, kb, block_bytes).permute(0, 2, 1, 3)  # [nb, kb, 16 features, block]
    parts = [blocks[..., 0:2].reshape(nb, kb, 32)]  # d, fp16
    if name == "q4_1":
        parts.append(blocks[..., 2:4].reshape(nb, kb, 32))  # m, fp16
    qs = blocks[..., block_bytes - (32 if name == "q8_0" else 16):]
    groups = qs.shape[-1] // 4  # dwords of 4 consecutive inputs (q8_0) or qs bytes (q4: nibble pairs)
    data = qs.reshape(nb, kb, FEATURES, groups, 4).permute(0, 1, 3, 2, 4).reshape(nb, kb, groups * 64)
    parts.append(data ^ 0x80 if name == "q8_0" else data)  # q8_0: unsigned bytes (q + 128)
    packed = torch.cat(parts, dim=-1).contiguous()
    assert packed.shape[-1] == unit
    return GgufWeight(packed, torch.zeros((), dtype=torch.float32).expand(n, kb * BLOCK), name)


def _ops():
    from tandem.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        raise RuntimeError("GGUF-quantized linears need tandem's C++ CPU ops, which did not build (see the log); "
                           "serve with --quantization none")
    return ops


# "portable", "vnni", "amx": the integer arithmetic's kernels; "amx_bf16": the bf16-tile arithmetic
PATHS = {"auto": 0, "portable": 1, "vnni": 2, "amx": 3, "amx_bf16": 4}


def linear(x: torch.Tensor, weight: GgufWeight, bias: torch.Tensor | None = None, out_fp32: bool = False,
           path: str = "auto") -> torch.Tensor:
    """x @ W.T (+ bias) in x's dtype (float32 with out_fp32). `path` (tests): which kernel computes it,
    "auto" the arithmetic of x's dtype on this CPU. The integer paths give the same bits as each other
    (one this CPU lacks falls back); "amx_bf16" takes bfloat16 x on a CPU with AMX-BF16 only."""
    return _ops().gguf_linear(x, weight.packed, weight.shape[0], bias, out_fp32, PATHS[path])


def rows(weight: GgufWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W as float32, dequantized as gguf's numpy dequantize does (bit for bit)."""
    return _ops().gguf_rows(weight.packed, weight.shape[0], ids)


def dequantize_raw(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """The file's rows as gguf's reference dequantizes them (float32 [out, in])."""
    from gguf.quants import dequantize

    return np.asarray(dequantize(np.asarray(raw), int(ggml_type)), dtype=np.float32)


def quantize_raw(weight: np.ndarray, ggml_type: int) -> np.ndarray:
    """A float [out, in] weight quantized by gguf's reference quantizer: the file's uint8 rows."""
    from gguf.quants import quantize

    return np.asarray(quantize(np.ascontiguousarray(weight, dtype=np.float32), int(ggml_type)))

"""GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quants Q4_K, Q5_K, Q6_K) repacked once for
kernels/csrc/gguf_linear_cpu.cpp, and the weight object the model's linears, its embedding and the
C++ decode step take. The K-quants' 256-input super-blocks are unpacked at load into 32-input units
holding the float32 scales gguf's dequantize computes (exact products: kernels/csrc/gguf_units.h);
Q5_0 and Q5_1 blocks become the same units as Q5_K's (weight = fma(d, u, m): m = -16 d for Q5_0,
its fp16 m for Q5_1, both exact), so every path computes with the file's weights bit for bit.
A fused linear whose parts are of different types (llama.cpp's Q4_K_M: Q5_0 q/k with a Q8_0 v) is a
group: each part packed as its type, behind a 64-byte header (`group`).

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

FEATURES, BLOCK, SUPER = 16, 32, 256  # a unit: 16 output features x 32 inputs; a K-quant super-block: 256 inputs
# ggml type id -> (name, block bytes in the file, unit bytes packed)
TYPES: dict[int, tuple[str, int, int]] = {2: ("q4_0", 18, 288), 3: ("q4_1", 20, 320), 6: ("q5_0", 22, 448),
                                          7: ("q5_1", 24, 448), 8: ("q8_0", 34, 544), 12: ("q4_k", 144, 384),
                                          13: ("q5_k", 176, 448), 14: ("q6_k", 210, 640)}
TYPE_IDS = {name: tid for tid, (name, _, _) in TYPES.items()}
K_QUANTS = frozenset(tid for tid, (name, _, _) in TYPES.items() if name.endswith("_k"))
UNPACKED = K_QUANTS | {6, 7}  # types whose blocks become units of float32 scales (the others' bytes move only)
GROUP_HEADER = 64  # bytes before a group's parts: int64 [parts, K/32, then (features, unit bytes) per part]
MAX_PARTS = (GROUP_HEADER // 8 - 2) // 2


@dataclass(frozen=True, eq=False)
class GgufWeight:
    """An [out, in] GGUF-quantized weight in the kernel's layout ([ceil(out/16), in/32, unit] uint8),
    or a group of such parts along `out` (1-D uint8: `group`'s header, then each part's bytes; `parts`
    views them as weights). `qtype`: the type's name, a group's its parts' joined by "+" ("q5_0+q5_0+q8_0")."""
    packed: torch.Tensor
    like: torch.Tensor
    qtype: str
    parts: tuple[GgufWeight, ...] = ()

    @property
    def shape(self) -> torch.Size:
        return self.like.shape

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


def supported(ggml_type: int, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this ggml type and [out, in] shape can be held packed."""
    block = SUPER if int(ggml_type) in K_QUANTS else BLOCK
    return int(ggml_type) in TYPES and len(shape) == 2 and shape[1] % block == 0


def pack(raw: torch.Tensor | np.ndarray, ggml_type: int) -> GgufWeight:
    """raw: the file's [out, in / 32 * block bytes] uint8 rows of one tensor (in / 256 for a K-quant;
    rows permuted or concatenated as the loader fuses them) -> the kernel's layout."""
    name, block_bytes, unit = TYPES[int(ggml_type)]
    if int(ggml_type) in UNPACKED:
        return _pack_units(np.asarray(raw), int(ggml_type))
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


def group(parts: list[GgufWeight]) -> GgufWeight:
    """Parts of one fused linear (the same input count, any types) -> one weight whose linear gives
    their outputs side by side: the C++ op runs each part's kernel (gguf_linear_cpu.cpp)."""
    k = parts[0].shape[1]
    if not 2 <= len(parts) <= MAX_PARTS or any(p.shape[1] != k or p.packed.dim() != 3 for p in parts):
        raise ValueError(f"group: 2 to {MAX_PARTS} packed weights of one input count, got "
                         f"{[tuple(p.shape) for p in parts]}")
    header = [len(parts), k // BLOCK] + [v for p in parts for v in (p.shape[0], p.packed.shape[2])]
    header_bytes = torch.tensor(header + [0] * (GROUP_HEADER // 8 - len(header)), dtype=torch.int64).view(torch.uint8)

    def aligned(part: torch.Tensor) -> torch.Tensor:  # each part starts on a 64-byte boundary
        flat = part.reshape(-1)
        return torch.cat([flat, flat.new_zeros(-flat.numel() % 64)])

    chunks = [header_bytes] + [aligned(p.packed) for p in parts]
    packed = torch.cat(chunks)
    starts = np.cumsum([c.numel() for c in chunks])[:-1]
    views = tuple(GgufWeight(packed[start:start + p.packed.numel()].view(p.packed.shape), p.like, p.qtype)
                  for p, start in zip(parts, starts))
    n = sum(p.shape[0] for p in parts)
    return GgufWeight(packed, torch.zeros((), dtype=torch.float32).expand(n, k), "+".join(p.qtype for p in parts),
                      views)


def _unpack(blocks: np.ndarray, ggml_type: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[B, block bytes] blocks -> u [B, inputs] uint8 (the unsigned stored values), the float32 scales
    d per 32 inputs ([B, 8] for a K-quant's 256; Q6_K per 16: [B, 16]; [B, 1] for Q5_0/Q5_1) and the
    float32 offsets m per 32 (None for Q6_K), as gguf.quants' dequantize_blocks computes them:
    weight = fma(d, u, m) (m = -(dmin * min) for Q4_K and Q5_K, -16 d for Q5_0, Q5_1's m), or
    d * (u - 32) for Q6_K."""
    count = blocks.shape[0]
    if ggml_type in (6, 7):  # Q5_0: fp16 d, qh[4], qs[16]; Q5_1: fp16 d, fp16 m, qh[4], qs[16]
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = -16 * d if ggml_type == 6 else blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qh = blocks[:, -20:-16].copy().view("<u4")  # bit i: bit 4 of input i
        qs = blocks[:, -16:]
        low = np.concatenate([qs & 15, qs >> 4], axis=-1)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        return low | high, d, m
    if ggml_type == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], fp16 d
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        low = (ql.reshape(count, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        high = (qh.reshape(count, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        return low.reshape(count, SUPER) | (high.reshape(count, SUPER) << 4), d * sc, None
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed_scales = blocks[:, 4:16].reshape(count, 3, 4)  # 6-bit scales and mins of the 8 sub-blocks
    lo, mid, top = packed_scales[:, 0], packed_scales[:, 1], packed_scales[:, 2]
    sc = np.concatenate([lo & 0x3F, (top & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1).astype(np.float32)
    qs = blocks[:, -128:]
    u = ((qs.reshape(count, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(count, SUPER)
    if ggml_type == 13:  # Q5_K: qh[32] after the scales, bit j of byte i = bit 4 of sub-block j's input i
        qh = blocks[:, 16:48]
        u = u | (((qh.reshape(count, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4).reshape(count, SUPER)
    return u, d * sc, -(dmin * mn)


def _pack_units(raw: np.ndarray, ggml_type: int) -> GgufWeight:
    """A K-quant's, Q5_0's or Q5_1's [out, blocks * block bytes] rows -> the kernel's units (gguf_units.h;
    Q5_0 and Q5_1 in Q5_K's)."""
    name, block_bytes, unit = TYPES[ggml_type]
    n, row_bytes = raw.shape
    if raw.dtype != np.uint8 or row_bytes % block_bytes:
        raise ValueError(f"{name}: rows of {row_bytes} bytes are not {block_bytes}-byte blocks")
    k = row_bytes // block_bytes * (SUPER if ggml_type in K_QUANTS else BLOCK)
    kb, nb = k // BLOCK, -(-n // FEATURES)
    packed = np.zeros((nb, kb, unit), dtype=np.uint8)
    step = 64  # feature blocks unpacked at a time (bounds the temporaries to ~1000 rows' worth)
    for fb0 in range(0, nb, step):
        rows = raw[fb0 * FEATURES:(fb0 + step) * FEATURES]
        fbs = -(-rows.shape[0] // FEATURES)
        u, d, m = _unpack(np.ascontiguousarray(rows).reshape(-1, block_bytes), ggml_type)
        pad = fbs * FEATURES - rows.shape[0]  # rows past n: zeros, never read
        u, d = (np.pad(a.reshape(rows.shape[0], -1), ((0, pad), (0, 0))) for a in (u, d))
        # [fbs, kb, 16 features, 32 inputs]
        u = u.reshape(fbs, FEATURES, kb, BLOCK).transpose(0, 2, 1, 3)

        def per_feature(scales: np.ndarray) -> np.ndarray:  # [rows, kb] float32 -> [fbs, kb, 64] bytes
            return np.ascontiguousarray(scales.reshape(fbs, FEATURES, kb).transpose(0, 2, 1)).view(np.uint8)

        if ggml_type == 14:
            d = d.reshape(fbs * FEATURES, kb, 2)
            parts = [per_feature(d[..., 0]), per_feature(d[..., 1])]
            # byte layout: byte 4f + i of group g = u of input 4g + i
            parts.append(u.reshape(fbs, kb, FEATURES, 8, 4).transpose(0, 1, 3, 2, 4).reshape(fbs, kb, 512))
        else:
            m = np.pad(m.reshape(rows.shape[0], -1), ((0, pad), (0, 0)))
            parts = [per_feature(d), per_feature(m)]
            nibbles = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)  # [fbs, kb, 16, 16]: Q4_0's qs bytes
            parts.append(nibbles.reshape(fbs, kb, FEATURES, 4, 4).transpose(0, 1, 3, 2, 4).reshape(fbs, kb, 256))
            if unit == 448:  # Q5_K, Q5_0, Q5_1: bit g of byte 4f + i: bit 4 of u of input 4g + i
                high = ((u >> 4) & 1).reshape(fbs, kb, FEATURES, 8, 4) << np.arange(8, dtype=np.uint8).reshape(1, 1, 1, 8, 1)
                parts.append(np.bitwise_or.reduce(high, axis=3).reshape(fbs, kb, 64))
        packed[fb0:fb0 + fbs] = np.concatenate(parts, axis=-1)
    return GgufWeight(torch.from_numpy(packed), torch.zeros((), dtype=torch.float32).expand(n, k), name)


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
    """Rows `ids` of W (not a group) as float32, dequantized as gguf's numpy dequantize does (bit for bit)."""
    return _ops().gguf_rows(weight.packed, weight.shape[0], ids)


def dequantize(weight: GgufWeight) -> torch.Tensor:
    """The whole weight as float32 [out, in], dequantized as gguf's numpy dequantize does (bit for
    bit); a group part by part."""
    if weight.parts:
        return torch.cat([dequantize(part) for part in weight.parts])
    return rows(weight, torch.arange(weight.shape[0]))


def dequantize_raw(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """The file's rows as gguf's reference dequantizes them (float32 [out, in])."""
    from gguf.quants import dequantize

    return np.asarray(dequantize(np.asarray(raw), int(ggml_type)), dtype=np.float32)


def quantize_raw(weight: np.ndarray, ggml_type: int) -> np.ndarray:
    """A float [out, in] weight quantized by gguf's reference quantizer: the file's uint8 rows."""
    from gguf.quants import quantize

    return np.asarray(quantize(np.ascontiguousarray(weight, dtype=np.float32), int(ggml_type)))

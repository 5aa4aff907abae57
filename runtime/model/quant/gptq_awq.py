"""GPTQ and AWQ int4 checkpoints (`--quantization gptq | awq`, or detected from config.json's
`quantization_config`): each quantized linear's (qweight, qzeros, scales[, g_idx]) converted once at
load into GGUF blocks of 32 inputs, served by the GGUF int4 kernels (gguf_blocks / gguf_load). The
quantization_config reading (`checkpoint_format`, `served`) also takes w8a8_int8's (w8a8_int8.py).

The formats (N output features, K inputs, group g of input k: g_idx[k], else k // group_size):
- GPTQ: qweight [K/8, N] int32, input k of column n in nibble k % 8 of word [k // 8, n]; qzeros
  [K/G, N/8] int32, column n in nibble n % 8 of word [g, n // 8]; scales [K/G, N]. checkpoint_format
  "gptq" (v1, AutoGPTQ) stores zero - 1, "gptq_v2" (GPTQModel) the zero. w = s * (q - zero).
- AWQ "gemm": qweight [K, N/8] and qzeros [K/G, N/8] int32 packed along the outputs, nibble i of
  word j holding column 8j + AWQ_ORDER[i]; scales [K/G, N]; zeros stored as they are. w = s * (q - zero).

The conversion, per 32-input block (each block must lie in one group: group sizes that are
multiples of 32, or -1, and a desc_act g_idx that keeps every block in one group):
- every zero of the tensor 8 -> Q4_0 with d = fp16(s), u = q: w = d * (u - 8), exact where the
  checkpoint's scales are fp16 (GPTQ's and AWQ's are);
- otherwise -> Q4_1 with d = fp16(s), m = fp16(-s * zero): s * zero is exact in float32 (11 + 5
  significant bits), so m is one rounding of it, |m + s * zero| <= 2^-11 |s * zero| (2^-25 below fp16's
  normal range) and each weight is off the checkpoint's by at most that: 2^-11 * 16 s = s / 128 at
  the largest zero, 1/128 of the quantization step.
The q/k/v and gate/up parts of a fused linear are made one type (Q4_0 parts rewritten as Q4_1 with
m = -8 d, exact). `--quantization none` (and a device or tensor-parallel size the kernels do not
serve, unless gptq/awq was asked for) dequantizes to s * (q - zero) in float32, exact, then --dtype.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.runtime.model.quant import siblings
from tandem.runtime.model.quant.gguf_blocks import BLOCK, TYPE_IDS
from tandem.runtime.model.quant.gguf_load import GgufPlan
from tandem.runtime.model.quant.w8a8_int8 import METHOD as W8A8_INT8
from tandem.runtime.model.quant.w8a8_int8 import Int8Format

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq")
CHECKPOINT_METHODS = (*METHODS, W8A8_INT8)  # the --quantization values a checkpoint's config declares
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
_AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c's nibble
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to a stored zero


@dataclass(frozen=True)
class Int4Format:
    """A checkpoint's int4 layout, from its quantization_config."""
    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group over all inputs
    zero_offset: int  # added to a stored zero (GPTQ v1: 1)


def _field(qc: dict, *keys: str, default=None):
    for key in keys:
        if key in qc:
            return qc[key]
    return default


def parse(qc: dict) -> Int4Format | Int8Format:
    """config.json's quantization_config -> the layout; ValueError naming the field tandem cannot serve."""
    method = str(qc.get("quant_method", "")).lower()
    where = "config.json quantization_config"
    if method == W8A8_INT8:
        return Int8Format()
    if method not in METHODS:
        raise ValueError(f"{where}.quant_method {qc.get('quant_method')!r} is not served; tandem serves "
                         f"{', '.join(METHODS)} (int4) and {W8A8_INT8} checkpoints")
    bits = _field(qc, "bits", "w_bit")
    if bits != 4:
        raise ValueError(f"{where}.bits {bits!r} is not served: tandem serves {method} at 4 bits")
    group = _field(qc, "group_size", "q_group_size", default=-1)
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % BLOCK == 0)):
        raise ValueError(f"{where}.group_size {group!r} is not served: a multiple of {BLOCK} or -1")
    if method == "awq":
        version = str(_field(qc, "version", default="gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}.version {version!r} is not served: AWQ's gemm layout only")
        if not _field(qc, "zero_point", default=True):
            raise ValueError(f"{where}.zero_point false is not served: AWQ with zeros only")
        return Int4Format("awq", group, 0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in _GPTQ_FORMATS:
        raise ValueError(f"{where}.checkpoint_format {fmt!r} is not served; tandem reads {', '.join(_GPTQ_FORMATS)}")
    if qc.get("lm_head"):
        raise ValueError(f"{where}.lm_head true (a quantized LM head) is not served")
    if qc.get("dynamic"):
        raise ValueError(f"{where}.dynamic (per-module settings) is not served")
    return Int4Format("gptq", group, _GPTQ_FORMATS[fmt])


def checkpoint_format(model_path: str, quantization: str | None) -> Int4Format | Int8Format | None:
    """The checkpoint's quantized layout when its config.json declares one (None: a plain checkpoint).
    ValueError where --quantization names gptq/awq/w8a8_int8 and the checkpoint is not that."""
    config = Path(model_path) / "config.json"
    qc = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if qc is None:
        if quantization in CHECKPOINT_METHODS:
            raise ValueError(f"--quantization {quantization}: {model_path} declares no quantization_config "
                             f"(not a {quantization} checkpoint)")
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{config}: quantization_config is not an object")
    try:
        fmt = parse(qc)
    except ValueError as e:
        raise ValueError(f"{config}: {e}") from None
    if quantization in ("gguf", *CHECKPOINT_METHODS) and quantization != fmt.method:
        raise ValueError(f"--quantization {quantization}: {model_path} is a {fmt.method} checkpoint "
                         f"(quantization_config.quant_method); use --quantization {fmt.method} or leave it unset")
    return fmt


def served(fmt: Int4Format | Int8Format, quantization: str | None, device: torch.device | str, tp_size: int) -> bool:
    """Whether the quantized linears stay quantized (else dequantized to --dtype). Asked for by name
    (gptq/awq/w8a8_int8) where the kernels cannot serve it: ValueError."""
    if quantization == "none":
        return False
    why_not = None
    if torch.device(device).type != "cpu":
        why_not = "the quantized linears run on CPU only"
    elif tp_size != 1:
        why_not = "quantized weights are not split across tensor-parallel ranks"
    elif fmt.method != W8A8_INT8:  # int8 runs on torch._int_mm
        from tandem.kernels.cpu_ops import load_cpu_ops

        if load_cpu_ops() is None:
            why_not = "tandem's C++ CPU ops did not build"
    if why_not is None:
        return True
    if quantization == fmt.method:
        raise ValueError(f"--quantization {fmt.method}: {why_not}; use --quantization none")
    logger.warning("%s checkpoint dequantized to --dtype: %s", fmt.method, why_not)
    return False


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """[R/8, C] int32 -> [R, C] in 0..15: row r from nibble r % 8 of word [r // 8, c] (GPTQ's qweight)."""
    shifts = 4 * torch.arange(8, dtype=torch.int32).view(1, 8, 1)
    return ((words.to(torch.int32)[:, None, :] >> shifts) & 0xF).reshape(words.shape[0] * 8, words.shape[1])


def unpack_columns(words: torch.Tensor, awq: bool) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] in 0..15: column 8j + c from nibble c (GPTQ) or _AWQ_COLUMN_NIBBLE[c] (AWQ)."""
    shifts = 4 * torch.arange(8, dtype=torch.int32)
    nibbles = (words.to(torch.int32)[:, :, None] >> shifts) & 0xF  # [R, C/8, nibble]
    if awq:
        nibbles = nibbles[:, :, list(_AWQ_COLUMN_NIBBLE)]
    return nibbles.reshape(words.shape[0], words.shape[1] * 8)


def _block_groups(fmt: Int4Format, k: int, g_idx: torch.Tensor | None, name: str) -> torch.Tensor:
    """The group of each 32-input block [K/32]; ValueError where a block spans two groups."""
    if k % BLOCK:
        raise ValueError(f"{name}: {k} inputs are not a multiple of {BLOCK}")
    if g_idx is None:
        g_idx = torch.zeros(k, dtype=torch.long) if fmt.group_size == -1 else torch.arange(k) // fmt.group_size
    blocks = g_idx.to(torch.long).view(k // BLOCK, BLOCK)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):
        raise ValueError(f"{name}.g_idx: an act-order (desc_act) permutation puts inputs of one {BLOCK}-input "
                         f"block in different groups; tandem's int4 blocks take one scale each (--quantization "
                         f"none serves it dequantized)")
    return blocks[:, 0]


def to_gguf_rows(fmt: Int4Format, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor | None = None, name: str = "weight") -> tuple[torch.Tensor, int]:
    """One quantized linear -> (its GGUF rows [N, K/32 * block bytes] uint8, the ggml type)."""
    awq = fmt.method == "awq"
    q = unpack_columns(qweight, awq=True) if awq else unpack_rows(qweight)  # [K, N]
    k, n = q.shape
    zeros = unpack_columns(qzeros, awq)[:, :n] + fmt.zero_offset  # [K/G, N]
    if scales.shape[-1] != n or zeros.shape != scales.shape:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} and qzeros {tuple(qzeros.shape)} do not match "
                         f"qweight's {n} outputs")
    groups = _block_groups(fmt, k, g_idx, name)
    s = scales.float()[groups].t().contiguous()  # [N, K/32]
    z = zeros[groups].t().contiguous()
    if s.abs().max() > 65504 or (s * z).abs().max() > 65504:
        raise ValueError(f"{name}: scales beyond fp16's range have no GGUF block")
    u = q.t().reshape(n, k // BLOCK, BLOCK).to(torch.uint8)
    qs = u[..., :16] | (u[..., 16:] << 4)  # low nibbles inputs 0..15, high 16..31
    d = _fp16_bytes(s)
    if bool((z == 8).all()):
        return torch.cat([d, qs], dim=-1).reshape(n, -1), TYPE_IDS["q4_0"]
    m = _fp16_bytes(-(s * z.float()))  # s * z exact in float32: one rounding, to fp16
    return torch.cat([d, m, qs], dim=-1).reshape(n, -1), TYPE_IDS["q4_1"]


def dequantize(fmt: Int4Format, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The checkpoint's weight W [N, K] = s * (q - zero) in float32 (exact for fp16 scales)."""
    awq = fmt.method == "awq"
    q = unpack_columns(qweight, awq=True) if awq else unpack_rows(qweight)
    k, n = q.shape
    zeros = unpack_columns(qzeros, awq)[:, :n] + fmt.zero_offset
    if g_idx is None:
        g_idx = torch.zeros(k, dtype=torch.long) if fmt.group_size == -1 else torch.arange(k) // fmt.group_size
    g = g_idx.to(torch.long)
    return (scales.float()[g] * (q - zeros[g]).float()).t().contiguous()


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., B] float -> [..., B, 2] uint8: each value rounded to fp16, little-endian."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _as_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_0 rows -> the same weights as Q4_1 rows (m = -8 d, exact)."""
    blocks = raw.view(raw.shape[0], -1, 18)
    d = blocks[..., :2].contiguous().view(torch.float16)
    m = (-8 * d).view(torch.uint8)
    return torch.cat([blocks[..., :2], m, blocks[..., 2:]], dim=-1).reshape(raw.shape[0], -1)


def convert(weights: dict[str, torch.Tensor], fmt: Int4Format, keep: bool) -> GgufPlan:
    """Replaces every `X.qweight/qzeros/scales[/g_idx]` of `weights` (Hugging Face names) by
    `X.weight`: GGUF rows (uint8) where `keep`, else the float32 dequantized weight. The returned
    plan names the kept rows' types (gguf_load.GgufPlan: packed after fusion, installed as GgufLinear).
    A fused linear (q/k/v, gate/up) stays quantized only if all its parts are quantized."""
    plan = GgufPlan()
    prefixes = [n.removesuffix(".qweight") for n in weights if n.endswith(".qweight")]
    for prefix in prefixes:
        parts = [weights.pop(f"{prefix}.{p}", None) for p in ("qweight", "qzeros", "scales", "g_idx")]
        if parts[1] is None or parts[2] is None:
            raise ValueError(f"{prefix}: qweight without {'qzeros' if parts[1] is None else 'scales'}")
        if keep and all(p in prefixes for p in siblings(prefix)):  # modules_to_not_convert may leave parts out
            weights[f"{prefix}.weight"], plan.types[f"{prefix}.weight"] = to_gguf_rows(fmt, *parts, name=prefix)
        else:
            weights[f"{prefix}.weight"] = dequantize(fmt, *parts)
    _one_type_per_fusion(weights, plan)
    return plan


def _one_type_per_fusion(weights: dict[str, torch.Tensor], plan: GgufPlan) -> None:
    """The parts of one fused linear in one type: with Q4_0 and Q4_1 parts, all Q4_1."""
    for name, ggml_type in list(plan.types.items()):
        if ggml_type != TYPE_IDS["q4_0"]:
            continue
        if any(plan.types[f"{n}.weight"] == TYPE_IDS["q4_1"] for n in siblings(name.removesuffix(".weight"))):
            weights[name], plan.types[name] = _as_q4_1(weights[name]), TYPE_IDS["q4_1"]

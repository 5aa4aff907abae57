"""Serving a GGUF file's quantized tensors as stored (`--quantization gguf`; unset means it where
TANDEM_GGUF_QUANTIZED=1): which tensors stay quantized, and the modules that hold them.

A linear weight stays quantized where its type has a kernel (gguf_blocks.TYPES: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, and Q4_K, Q5_K, Q6_K where its input count is whole 256-input super-blocks) and so does
every tensor fused with it (q/k/v into qkv_proj, gate/up into gate_up_proj). Parts of one type are
fused as rows; parts of several (llama.cpp's Q4_K_M: Q5_0 q/k with a Q8_0 v) become a group, each
part packed as its own type (gguf_blocks.group). The token embedding (and the LM head tied to it, or
the file's own output.weight) likewise. Everything else (norms, other block types) is dequantized to
--dtype as on the reference path (`--quantization none`). Rows only are fused, permuted
(llama.cpp's rope order) or sharded, never columns, so a tensor's file bytes are reordered, never
re-quantized (the K-quants', Q5_0's and Q5_1's blocks are unpacked into units of the same weights:
gguf_blocks.pack).

No fp32 cache file is written on this path: the file's blocks are read from its memory map and
repacked once (gguf_blocks.pack), the resident weights being about the file's size (the
K-quants' float32 scales make theirs larger: 384, 448 and 640 bytes per 16 x 32 weights for Q4_K,
Q5_K, Q6_K against the file's 288, 352 and 420).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.runtime.envs import envs
from tandem.runtime.model.quant import PART_OF, siblings
from tandem.runtime.model.quant.gguf_blocks import GgufWeight, group, linear, pack, rows, supported
from tandem.runtime.server_args import QUANTIZATIONS

logger = logging.getLogger(__name__)


def wanted(quantization: str | None, model_path: str, device: torch.device | str, tp_size: int) -> bool:
    """Whether to serve `model_path`'s quantized tensors quantized (ValueError where gguf is asked
    for and cannot be served). None (SGLang's default) and "auto": gguf for a GGUF file on CPU with
    the C++ ops built where TANDEM_GGUF_QUANTIZED says so, none otherwise."""
    from tandem.runtime.model_files import is_gguf

    if quantization not in QUANTIZATIONS:  # ServerArgs refuses them first; a direct caller here
        raise ValueError(f"--quantization: {quantization!r} is not one of {QUANTIZATIONS}")
    if quantization == "none" or (quantization != "gguf" and not envs.GGUF_QUANTIZED.get()):
        return False
    why_not = None
    if not is_gguf(model_path):
        why_not = "the model is not a GGUF file (HF checkpoints are served in --dtype)"
    elif torch.device(device).type != "cpu":
        why_not = "the GGUF kernels run on CPU only"
    elif tp_size != 1:
        why_not = "quantized weights are not split across tensor-parallel ranks"
    else:
        from tandem.kernels.cpu_ops import load_cpu_ops

        if load_cpu_ops() is None:
            why_not = "tandem's C++ CPU ops did not build"
    if why_not is not None:
        if quantization == "gguf":
            raise ValueError(f"--quantization gguf: {why_not}; use --quantization none")
        return False
    return True


@dataclass
class GgufPlan:
    """Which of a file's tensors stay quantized (by their Hugging Face name) and their ggml types;
    `mixed`: the fused linears whose parts differ in type (their parts' names), packed as groups."""
    types: dict[str, int] = field(default_factory=dict)
    mixed: list[tuple[str, ...]] = field(default_factory=list)
    groups: dict[str, GgufWeight] = field(default_factory=dict)  # fused name -> group, by pack_groups

    def fill(self, reader, hf_name) -> None:
        """Decides for every tensor of `reader` (a GGUFReader); `hf_name(tensor)`: the loader's
        Hugging Face name of a file tensor (None: not read)."""
        for t in reader.tensors:
            name = hf_name(t)
            shape = tuple(int(d) for d in reversed(t.shape))
            if (name is None or not name.endswith(".weight") or name.endswith("norm.weight") or ".experts." in name
                    or not supported(t.tensor_type, shape)
                    or not (name.startswith("model.layers.") or name in ("model.embed_tokens.weight", "lm_head.weight"))):
                continue
            self.types[name] = int(t.tensor_type)
        # a fused linear stays quantized only if all its parts are; parts of several types make a group
        fused = {tuple(f"{p}.weight" for p in siblings(name.removesuffix(".weight"))) for name in self.types}
        for names in sorted(fused):
            kinds = {self.types.get(n) for n in names}
            if None in kinds:
                for n in names:
                    self.types.pop(n, None)
            elif len(kinds) > 1:
                self.mixed.append(names)

    def pack_groups(self, weights: dict[str, torch.Tensor]) -> None:
        """Pops each mixed fused linear's parts (the file's rows, Hugging Face names) out of `weights`,
        before the loader fuses rows, and packs them as one group under the fused name."""
        for names in self.mixed:
            module, _, proj = names[0].removesuffix(".weight").rpartition(".")
            fused_name = f"{module.removeprefix('model.')}.{PART_OF[proj]}.weight"
            self.groups[fused_name] = group([pack(weights.pop(n), self.types[n]) for n in names])

    def keeps(self, name: str) -> bool:
        return name in self.types

    def type_of(self, fused_name: str) -> int | None:
        """The type of a weight by its fused name (runtime/model/loader.py's _fuse)."""
        for candidate in (fused_name, f"model.{fused_name}", f"model.{fused_name.replace('qkv_proj', 'q_proj')}",
                          f"model.{fused_name.replace('gate_up_proj', 'gate_proj')}"):
            if candidate in self.types:
                return self.types[candidate]
        return None

    def take(self, weights: dict[str, torch.Tensor]) -> dict[str, GgufWeight]:
        """Pops the file's raw rows out of `weights` (fused names) and packs them (with pack_groups' groups)."""
        held = dict(self.groups)
        for name in [n for n, t in weights.items() if t.dtype == torch.uint8]:
            ggml_type = self.type_of(name)
            if ggml_type is None:
                raise ValueError(f"{name}: raw GGUF rows of no known type")
            held[name] = pack(weights.pop(name), ggml_type)
        return held


class GgufLinear(nn.Module):
    """A linear on a GGUF-quantized weight; activations in their dtype, output in it."""

    def __init__(self, weight: GgufWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class GgufEmbedding(nn.Module):
    """The token embedding from quantized rows: each row dequantized as the reference path's
    (float32 d * q (+ m), then --dtype), so embeddings are the reference path's bits."""

    def __init__(self, weight: GgufWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return rows(self.weight, ids).to(self.dtype).view(*ids.shape, self.weight.shape[1])


def install(model: nn.Module, held: dict[str, GgufWeight], dtype: torch.dtype) -> None:
    """Puts the packed weights in place of their modules' (after the loader set every other parameter)."""
    for name, weight in held.items():
        module_name, _, attr = name.rpartition(".")
        parent_name, _, child = module_name.rpartition(".")
        parent, module = model.get_submodule(parent_name), model.get_submodule(module_name)
        if attr != "weight":
            raise ValueError(f"{name}: only weights are held quantized")
        if isinstance(module, nn.Linear):
            setattr(parent, child, GgufLinear(weight, module.bias))
        elif child == "embed_tokens":
            setattr(parent, child, GgufEmbedding(weight, dtype))
        else:
            raise ValueError(f"{name}: a {type(module).__name__} cannot hold a quantized weight")
    kinds = Counter(kind for w in held.values() for kind in w.qtype.split("+"))
    if held:
        from tandem.kernels.cpu_ops import load_cpu_ops

        logger.info("GGUF weights served quantized: %s (%.1f MB), kernels: %s",
                    ", ".join(f"{c} {k.upper()}" for k, c in sorted(kinds.items())),
                    sum(w.nbytes for w in held.values()) / 1e6, load_cpu_ops().gguf_isa())


def quantized_names(model: nn.Module) -> set[str]:
    """The weights held quantized, by tandem's (fused) names."""
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, (GgufLinear, GgufEmbedding))}


def quantization_of(model: nn.Module) -> str:
    """What the model's linears hold: 'gguf:q4_1+q8_0', 'gguf:q4_k+q6_k' (types, sorted), or 'none'."""
    kinds = sorted({kind for m in model.modules() if isinstance(m, (GgufLinear, GgufEmbedding))
                    for kind in m.weight.qtype.split("+")})
    return "gguf:" + "+".join(kinds) if kinds else "none"


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold in memory, as held (quantized, packed, plain), each storage once."""
    return held_bytes(value for module in model.modules()
                      for value in (*module._parameters.values(), *vars(module).values()))


def held_bytes(values) -> int:
    """Bytes of the tensors and packed weights among `values` (anything else is skipped), each storage once."""
    seen: set[int] = set()
    total = 0
    for value in values:
        t = value.packed if hasattr(value, "packed") else value  # AMX / MKL / GGUF packed weights
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
    return total

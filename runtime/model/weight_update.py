"""Weight updates in place: Hugging Face-named tensors into the serving model's parameters.

The model holds fused (qkv, gate_up, stacked experts), tensor-parallel-sharded and, on CPU,
packed weights (packed_linear.py). `locate` maps a checkpoint name to the slice of the fused
parameter its rank's shard fills, by the loader's own fusing and sharding rules.

Invariant: an update changes every named weight or none. Every name, shape and dtype is checked
before the first copy (`check`), and a bad one raises a ValueError naming it while the old weights
keep serving; only then, with every value in hand, are they written into the serving parameters
(`apply`). After a change the C++ decode step, which holds the weights it was built on, is made
again on first use, and the LM head's fp32-logits copy is made from the new head.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.loader import _fuse
from tandem.runtime.model.packed_linear import AmxPackedWeight, PackedLinear, linear, pack
from tandem.runtime.model.packed_rows import write_rows
from tandem.runtime.model import quant
from tandem.runtime.model.quant import gguf_blocks, gguf_load
from tandem.runtime.model.tensor_parallel import TensorParallel, shard_weights

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_PLACEHOLDER = torch.empty(0)


@dataclass(frozen=True)
class Target:
    """Where this rank's part of a checkpoint tensor goes: `param[index] = shard(tensor)`."""
    param: str
    index: tuple[slice | int, ...]
    shard: Callable[[torch.Tensor], torch.Tensor]


def locate(name: str, cfg: ModelConfig, tp: TensorParallel, renamed: dict[str, str] | None = None) -> Target:
    """The target of checkpoint tensor `name` (check() refuses one whose param the model lacks).
    A tied model's `lm_head.weight` targets the embedding it is tied to. `renamed`: the loader's
    names of many checkpoint names at once (`loader_names`), where a caller has them."""
    part = lambda t, dim=0: t.chunk(tp.size, dim=dim)[tp.rank].contiguous()  # noqa: E731
    stem, _, kind = name.removeprefix("model.").rpartition(".")
    module, _, proj = stem.rpartition(".")
    if proj in _FUSED and ".experts." not in stem:  # one part of a fused dense linear
        fused, position = _FUSED[proj]
        sizes = ([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
                 if fused == "qkv_proj" else [cfg.intermediate_size] * 2)
        sizes = [s // tp.size for s in sizes]
        first = sum(sizes[:position])
        return Target(f"{module}.{fused}.{kind}", (slice(first, first + sizes[position]),), part)
    # every other name as the loader renames it (prefix, row-parallel biases, Mixtral's experts)
    local = (renamed or {}).get(name) or next(iter(_fuse({name: _PLACEHOLDER}, cfg)), "embed_tokens.weight")
    # (a tied head is dropped by the loader: it targets the embedding)
    stem, _, kind = local.rpartition(".")
    module, _, proj = stem.rpartition(".")
    if ".experts." in stem and module.split(".")[-1].isdigit():  # layers.i.mlp.experts.e.{gate,up,down}_proj
        experts, _, expert = module.rpartition(".")
        if proj == "down_proj":  # [E, H, I]: the expert's input columns split
            return Target(f"{experts}.down_proj", (int(expert),), lambda t: part(t, 1))
        rows = (getattr(cfg, "moe_intermediate_size", 0) or cfg.intermediate_size) // tp.size
        first = rows * _FUSED[proj][1]
        return Target(f"{experts}.gate_up_proj", (int(expert), slice(first, first + rows)), part)
    return Target(local, (), lambda t: shard_weights({local: t}, cfg, tp)[local])


def loader_names(names: list[str], cfg: ModelConfig) -> dict[str, str]:
    """The loader's name (_fuse) of each checkpoint name it keeps whole, found in one pass over the
    layers rather than one a name. Fused, stacked and dropped names are left out."""
    placeholders = {name: torch.empty(0) for name in names}
    local_of = {id(t): local for local, t in _fuse(placeholders, cfg).items()}
    return {name: local_of[id(t)] for name, t in placeholders.items() if id(t) in local_of}


def gather_shards(local: torch.Tensor, target: Target, tp: TensorParallel) -> torch.Tensor:
    """The whole checkpoint tensor from each rank's `local` part of it (a collective: every TP rank
    calls it). The split dimension is the one `target.shard` divides; a replicated one is returned as is."""
    import torch.distributed as dist

    probe = torch.empty([n * tp.size for n in local.shape], device="meta")
    split = [dim for dim, (whole, part) in enumerate(zip(probe.shape, target.shard(probe).shape)) if whole != part]
    if not split:
        return local
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    return torch.cat(parts, dim=split[0])


def read(model: nn.Module, param: str) -> torch.Tensor:
    """A parameter's current value as a plain tensor. A packed linear's weight is read back
    through its own kernel: identity @ W^T sums one product and zeros a row, which is exact."""
    module_name, _, attr = param.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, (gguf_load.GgufLinear, gguf_load.GgufEmbedding)) and attr == "weight":
        return gguf_blocks.dequantize(module.weight)  # float32, as `--quantization none` reads the file
    if isinstance(module, PackedLinear) and attr == "weight":
        eye = torch.eye(module.weight.shape[1], dtype=_packed_dtype(module))
        return linear(eye, module.weight).t().to(eye.dtype).contiguous()
    return getattr(module, attr).detach()


def _packed_dtype(module: PackedLinear) -> torch.dtype:
    weight = module.weight
    return getattr(weight, "like", weight).dtype


def check(model: nn.Module, cfg: ModelConfig, tp: TensorParallel,
          tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[Target, torch.Tensor]]:
    """Each tensor's target and this rank's part of it; a ValueError names the first that does
    not fit (unknown name, wrong shape, a dtype that is not floating point)."""
    params, quantized = shapes(model), quant.quantized_weights(model)
    tensors = list(tensors)
    renamed = loader_names([name for name, _ in tensors], cfg)
    out = []
    for name, tensor in tensors:
        target = locate(name, cfg, tp, renamed)
        if target.param in quantized:
            raise ValueError(f"{name}: the model holds this weight quantized ({quant.held_label(model)}); "
                             f"weight updates need the dequantized path (--quantization none)")
        if target.param not in params:
            raise ValueError(f"{name}: the model has no such weight")
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating-point type")
        shard = target.shard(tensor)
        want = torch.empty(params[target.param], device="meta")[target.index].shape
        if shard.shape != want:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit the model's weight "
                             f"(this rank's part is {tuple(shard.shape)}, the model holds {tuple(want)})")
        out.append((target, shard))
    return out


def apply(model: nn.Module, checked: list[tuple[Target, torch.Tensor]]) -> int:
    """Write checked updates, every tensor in hand, into the serving parameters; returns how many
    parameters changed. The values are all in memory and checked, so the writes cannot stop part
    way (a broadcast update receives every byte first: weight_sync.receive). An AMX-packed weight is
    written in its packed layout (packed_rows.write_rows: converting, copying and repacking in one
    pass), and the LM head's AMX copy (CausalLM.logits) with the head weight; another packed layout
    is packed again from its plain value."""
    by_param: dict[str, list[tuple[Target, torch.Tensor]]] = {}
    for target, shard in checked:
        by_param.setdefault(target.param, []).append((target, shard))
    head = model._head_weight()
    for param, parts in by_param.items():
        module, attr = _owner(model, param)
        value = getattr(module, attr)
        if isinstance(value, AmxPackedWeight):
            for target, shard in parts:
                write_rows(value.packed, target.index[0].start if target.index else 0, shard)
        elif isinstance(module, PackedLinear) and attr == "weight":  # another packed layout: plain, packed again
            plain = (torch.empty(value.shape, dtype=_packed_dtype(module)) if _covers([t for t, _ in parts], value.shape)
                     else read(model, param).clone())
            for target, shard in parts:
                plain[target.index].copy_(shard)
            module.weight = pack(plain)
        else:
            for target, shard in parts:
                value.detach()[target.index].copy_(shard)
        if value is head:
            _refresh_head_copy(model, head)
    model._decode_step_checked_for = None  # rebuilt on the next decode step, on the new weights
    return len(by_param)


def _refresh_head_copy(model: nn.Module, head: torch.Tensor) -> None:
    """The LM head's AMX copy (CausalLM.logits) written from the new head; any other copy is
    dropped, to be made again from the new head on first use."""
    copy = getattr(model, "_head_fp32", None)
    if isinstance(copy, AmxPackedWeight) and head.dtype == torch.bfloat16:
        write_rows(copy.packed, 0, head.detach())
    else:
        model._head_fp32 = None


def _owner(model: nn.Module, param: str) -> tuple[nn.Module, str]:
    module_name, _, attr = param.rpartition(".")
    return model.get_submodule(module_name), attr


def _covers(parts: list[Target], shape: torch.Size) -> bool:
    """Whether the parts' indexes together write every element of a parameter of `shape`."""
    if any(target.index == () for target in parts):
        return True
    depth = max(len(target.index) for target in parts)
    written = torch.zeros(shape[:depth], dtype=torch.bool)
    for target in parts:
        written[target.index] = True
    return bool(written.all())


def shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Every parameter's shape by tandem's name, packed and quantized weights included."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, (gguf_load.GgufLinear, gguf_load.GgufEmbedding)):
            shapes[f"{name}.weight"] = module.weight.shape
        if isinstance(module, PackedLinear):
            shapes[f"{name}.weight"] = module.weight.shape
            if module.bias is not None:
                shapes[f"{name}.bias"] = module.bias.shape
    return shapes

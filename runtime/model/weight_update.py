"""Weight updates in place: Hugging Face-named tensors into the serving model's parameters.

The model holds fused (qkv, gate_up, stacked experts), tensor-parallel-sharded and, on CPU,
packed weights (packed_linear.py). `locate` maps a checkpoint name to the slice of the fused
parameter its rank's shard fills, by the loader's own fusing and sharding rules.

Invariant: an update changes every named weight or none. Every name, shape and dtype is checked
before the first copy, and a bad one raises a ValueError naming it while the old weights keep
serving. After a change the C++ decode step and the fp32 LM head copy, which hold the weights
they were built on, are made again on first use.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.loader import _fuse
from tandem.runtime.model.packed_linear import PackedLinear, linear, pack
from tandem.runtime.model.quant import gguf_load
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


def locate(name: str, cfg: ModelConfig, tp: TensorParallel) -> Target:
    """The target of checkpoint tensor `name` (check() refuses one whose param the model lacks).
    A tied model's `lm_head.weight` targets the embedding it is tied to."""
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
    local = next(iter(_fuse({name: _PLACEHOLDER}, cfg)), "embed_tokens.weight")  # (a tied head: dropped)
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


def read(model: nn.Module, param: str) -> torch.Tensor:
    """A parameter's current value as a plain tensor. A packed linear's weight is read back
    through its own kernel: identity @ W^T sums one product and zeros a row, which is exact."""
    module_name, _, attr = param.rpartition(".")
    module = model.get_submodule(module_name)
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
    params, quantized = shapes(model), gguf_load.quantized_names(model)
    out = []
    for name, tensor in tensors:
        target = locate(name, cfg, tp)
        if target.param in quantized:
            raise ValueError(f"{name}: the model holds this weight quantized (--quantization gguf); weight "
                             f"updates need the dequantized path (--quantization none)")
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
    """Write checked updates into the model; returns the parameters changed."""
    by_param: dict[str, list[tuple[Target, torch.Tensor]]] = {}
    for target, shard in checked:
        by_param.setdefault(target.param, []).append((target, shard))
    for param, parts in by_param.items():
        module_name, _, attr = param.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, PackedLinear) and attr == "weight":
            value = _written_whole(parts, module.weight.shape, _packed_dtype(module))
            if value is None:  # some rows keep their old values: read them back first
                value = read(model, param).clone()
            for target, shard in parts:
                value[target.index] = shard.to(value.dtype)
            module.weight = pack(value)
        else:
            value = getattr(module, attr)
            with torch.no_grad():
                for target, shard in parts:
                    value[target.index] = shard.to(dtype=value.dtype, device=value.device)
    model._decode_step_checked_for = None  # rebuilt on the next decode step, on the new weights
    model._head_fp32 = None  # the fp32 head copy likewise (CausalLM.logits)
    return len(by_param)


def _written_whole(parts: list[tuple[Target, torch.Tensor]], shape: torch.Size,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialized tensor when `parts` write every row of the parameter (a whole checkpoint's
    q, k and v, say), so its old value need not be read back; else None."""
    rows: set[int] = set()
    for target, _ in parts:
        if target.index == ():
            return torch.empty(shape, dtype=dtype)
        if len(target.index) != 1 or not isinstance(target.index[0], slice):
            return None
        rows.update(range(target.index[0].start, target.index[0].stop))
    return torch.empty(shape, dtype=dtype) if len(rows) == shape[0] else None


def shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Every parameter's shape by tandem's name, packed linears' weights included."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            shapes[f"{name}.weight"] = module.weight.shape
            if module.bias is not None:
                shapes[f"{name}.bias"] = module.bias.shape
    return shapes

"""Weight updates in place: Hugging Face-named tensors into the serving model's parameters.

The model holds fused (qkv, gate_up, stacked experts), tensor-parallel-sharded and, on CPU,
packed weights (packed_linear.py). `locate` maps a checkpoint name to the slice of the fused
parameter its rank's shard fills, by the loader's own fusing and sharding rules.

Invariant: an update changes every named weight or none. Every name, shape and dtype is checked
before the first copy (`check`), and a bad one raises a ValueError naming it while the old weights
keep serving; the new values are written apart from the serving ones and put in at once
(`Staged`). After a change the C++ decode step, which holds the weights it was built on, is made
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


def apply(model: nn.Module, checked: list[tuple[Target, torch.Tensor]], in_place: bool = True) -> int:
    """Write checked updates, all in hand, into the model; returns the parameters changed."""
    staged = Staged(model, [target for target, _ in checked], in_place)
    for target, shard in checked:
        staged.write(target, shard)
    return staged.commit()


class Staged:
    """The new values of the parameters an update names: `write` fills them (in any order, as
    tensors arrive), `commit` makes the model serve them.

    Invariant: staged apart (`in_place=False`), the model is unchanged until `commit`, so an update
    that fails part way (a trainer gone mid-broadcast) leaves the old weights serving; a parameter
    written whole then starts uninitialized, one written in part as a copy of its value. In place,
    the serving parameters are written: for updates whose every tensor is in hand and checked,
    which cannot stop part way, and which then touch no fresh memory. An AMX-packed weight is
    written in its packed layout (packed_rows.write_rows): converting, copying and repacking are
    one pass; the LM head's AMX copy (CausalLM.logits) is written with the head weight."""

    def __init__(self, model: nn.Module, targets: Iterable[Target], in_place: bool = False) -> None:
        self.model, self.in_place = model, in_place
        by_param: dict[str, list[Target]] = {}
        for target in targets:
            by_param.setdefault(target.param, []).append(target)
        self.slots = {param: self._slot(param, parts) for param, parts in by_param.items()}
        self.head = self._head_slot()

    def _slot(self, param: str, parts: list[Target]) -> _Slot:
        module, attr = _owner(self.model, param)
        value = getattr(module, attr)
        whole = _covers(parts, value.shape)
        if isinstance(value, AmxPackedWeight):
            buffer = value.packed if self.in_place else torch.empty_like(value.packed) if whole else value.packed.clone()
            return _Slot(module, attr, buffer, amx=True)
        if isinstance(module, PackedLinear) and attr == "weight":  # another packed layout: plain, packed at commit
            plain = torch.empty(value.shape, dtype=_packed_dtype(module)) if whole else read(self.model, param).clone()
            return _Slot(module, attr, plain)
        buffer = value.detach() if self.in_place else torch.empty_like(value) if whole else value.detach().clone()
        return _Slot(module, attr, buffer)

    def _head_slot(self) -> tuple[str, torch.Tensor] | None:
        """(the head weight's param, a buffer for its AMX copy) when this update writes the head
        and the head has an AMX copy; other copies are made again on first use (commit)."""
        head = self.model._head_weight()
        param = next((p for p, slot in self.slots.items() if getattr(slot.module, slot.attr) is head), None)
        old = getattr(self.model, "_head_fp32", None)
        if param is None or not isinstance(old, AmxPackedWeight) or head.dtype != torch.bfloat16:
            return None
        return param, old.packed if self.in_place else torch.empty_like(old.packed)

    def write(self, target: Target, shard: torch.Tensor) -> None:
        """Stage this rank's part of one checked tensor (dtype converted here)."""
        slot = self.slots[target.param]
        if slot.amx:
            write_rows(slot.buffer, target.index[0].start if target.index else 0, shard)
        else:
            slot.buffer[target.index].copy_(shard)
        if self.head is not None and self.head[0] == target.param:  # the head weight: its index is ()
            write_rows(self.head[1], 0, slot.buffer)

    def commit(self) -> int:
        """Make the model serve every staged value; returns how many parameters changed."""
        head = self.model._head_weight()
        head_changed = any(getattr(slot.module, slot.attr) is head for slot in self.slots.values())
        for slot in self.slots.values():
            value = getattr(slot.module, slot.attr)
            if slot.amx:
                if not self.in_place:
                    slot.module.weight = AmxPackedWeight(slot.buffer, value.like)
            elif isinstance(slot.module, PackedLinear) and slot.attr == "weight":
                slot.module.weight = pack(slot.buffer)
            elif self.in_place:
                continue
            elif isinstance(value, nn.Parameter):
                value.data = slot.buffer  # the Parameter stays the one the model (and a tied head) holds
            else:
                setattr(slot.module, slot.attr, slot.buffer)
        if self.head is not None:
            self.model._head_fp32 = AmxPackedWeight(self.head[1], self.model._head_fp32.like)
        elif head_changed:
            self.model._head_fp32 = None  # made again from the new head on first use
        self.model._decode_step_checked_for = None  # rebuilt on the next decode step, on the new weights
        return len(self.slots)


@dataclass
class _Slot:
    """One parameter's new value: `buffer` is in the AMX packed layout where `amx`, else plain."""
    module: nn.Module
    attr: str
    buffer: torch.Tensor
    amx: bool = False


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
    """Every parameter's shape by tandem's name, packed linears' weights included."""
    shapes = {name: p.shape for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, PackedLinear):
            shapes[f"{name}.weight"] = module.weight.shape
            if module.bias is not None:
                shapes[f"{name}.bias"] = module.bias.shape
    return shapes

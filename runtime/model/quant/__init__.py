"""Quantized weights served quantized (issue 49): GGUF blocks kept as the file stores them, repacked
once at load for the C++ kernels (kernels/csrc/gguf_linear_cpu.cpp)."""
from __future__ import annotations

from torch import nn

# the loader's fused linears (loader._fuse) and the Hugging Face linears each concatenates, in order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PART_OF = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}


def siblings(prefix: str) -> list[str]:
    """The Hugging Face linears fused with linear `prefix` ("...mlp.up_proj"), itself included, in order."""
    module, _, proj = prefix.rpartition(".")
    return [f"{module}.{p}" for p in FUSED_PARTS[PART_OF[proj]]] if proj in PART_OF else [prefix]


def held_label(model: nn.Module) -> str:
    """How the model's weights are held, as /server_info reports it: "gguf:q4_1+q8_0" (the block
    types), "gptq:q4_0" / "awq:q4_1" (a checkpoint served on the GGUF int4 kernels), "w8a8_int8", or
    "none" (in --dtype)."""
    from tandem.runtime.model.quant import gguf_load, w8a8_int8

    label = w8a8_int8.held_as(model) or gguf_load.quantization_of(model)
    source = getattr(model, "checkpoint_quantization", None)  # set by the loader for GPTQ/AWQ
    return f"{source}:{label.removeprefix('gguf:')}" if source and label.startswith("gguf:") else label


def quantized_weights(model: nn.Module) -> set[str]:
    """The weights held quantized (GGUF blocks or int8), by tandem's (fused) names."""
    from tandem.runtime.model.quant import gguf_load, w8a8_int8

    return gguf_load.quantized_names(model) | {f"{name}.weight" for name, m in model.named_modules()
                                              if isinstance(m, w8a8_int8.Int8Linear)}

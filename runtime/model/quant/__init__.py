"""Quantized weights served quantized (issue 49): GGUF blocks kept as the file stores them, repacked
once at load for the C++ kernels (kernels/csrc/gguf_linear_cpu.cpp)."""

# the loader's fused linears (loader._fuse) and the Hugging Face linears each concatenates, in order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PART_OF = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}


def siblings(prefix: str) -> list[str]:
    """The Hugging Face linears fused with linear `prefix` ("...mlp.up_proj"), itself included, in order."""
    module, _, proj = prefix.rpartition(".")
    return [f"{module}.{p}" for p in FUSED_PARTS[PART_OF[proj]]] if proj in PART_OF else [prefix]

"""Small building blocks: RMSNorm and rotary embedding; their math comes from the model's ops (torch or Triton)."""
from __future__ import annotations

import math

import torch
from torch import nn

from tandem.runtime.model.ops import TorchOps


class RMSNorm(nn.Module):
    ops = TorchOps()  # replaced per model by CausalLM.use_ops

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rmsnorm(x, self.weight, self.eps)
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as Llama/Qwen/Mistral checkpoints use."""

    ops = TorchOps()

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "llama3":
            inv_freq = _llama3_scale(inv_freq, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]."""
        return self.ops.rotary(positions, q, k, self.cos_sin)


def _llama3_scale(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    factor, low, high = cfg["factor"], cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_len = cfg.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)

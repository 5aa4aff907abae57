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
        rope_type = rope_scaling["rope_type"] if rope_scaling else "default"  # validated by ModelConfig
        attention_factor = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_scale(inv_freq, rope_scaling)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_scale(inv_freq, base, head_dim, max_position, rope_scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin", cos_sin * attention_factor if attention_factor != 1.0 else cos_sin,
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]."""
        return self.ops.rotary(positions, q, k, self.cos_sin)


def _llama3_scale(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    factor, low, high = cfg["factor"], cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_len = cfg["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _yarn_scale(inv_freq: torch.Tensor, base: float, head_dim: int, max_position: int,
                cfg: dict) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' and SGLang's): low frequencies interpolated by `factor`, high ones kept,
    a linear ramp between; cos and sin scaled by the attention factor."""
    old_len = cfg["original_max_position_embeddings"]
    factor = cfg.get("factor") or max_position / old_len
    attention_factor = cfg.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = cfg.get("mscale"), cfg.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.get("beta_fast") or 32), correction_dim(cfg.get("beta_slow") or 1)
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

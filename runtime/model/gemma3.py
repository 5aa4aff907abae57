"""Gemma 3's text model on the shared decoder (runtime/model/llama.py), with its own pieces:

- the token embedding times sqrt(hidden) (rounded to the model's dtype first, as transformers does);
- RMSNorm of the (1 + weight) form, normalized and weighted in float32 and rounded once;
- four norms a layer: input, post-attention, pre- and post-feedforward; q/k norms in attention;
- the GELU-tanh gated MLP (cfg.hidden_act "gelu_tanh");
- sliding-window (local) layers beside global ones, each kind with its own rope base;
- scores scaled by query_pre_attn_scalar ** -0.5, and the final logits softcapped where the config
  says (CausalLM.logits).

Checkpoints hold each norm's `weight` as transformers does (the (1 + weight) form adds 1 at run
time); a GGUF stores 1 + weight, and the loader subtracts the 1 (runtime/model/loader.py).
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.runtime.model.attention import AttentionBackend
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.forward_batch import ForwardBatch
from tandem.runtime.model.layers import RotaryEmbedding
from tandem.runtime.model.llama import MLP, Attention, CausalLM
from tandem.runtime.model.ops import TorchOps
from tandem.runtime.model.tensor_parallel import SINGLE, TensorParallel


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight); with a residual, the norm of x + residual and that sum."""
    ops = TorchOps()  # replaced per model by CausalLM.use_ops

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.gemma_rmsnorm(x, self.weight, self.eps)
        summed = residual + x
        return self.ops.gemma_rmsnorm(summed, self.weight, self.eps), summed


class Gemma3Attention(Attention):
    norm_class = GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    """Between layers the hidden state travels as (x, residual) with x + residual the state, so a
    norm and the residual add that precedes it run as one op, as in the Llama layer."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Gemma3Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                rotary: RotaryEmbedding, attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, batch, rotary, attn))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(CausalLM):
    layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, tp)
        self.embed_scale = cfg.hidden_size ** 0.5

    def build_rotary(self, device: torch.device | str | None = None) -> None:
        """Global layers rotate with rope_theta (and its scaling), window layers with the local base."""
        super().build_rotary(device)
        cfg = self.cfg
        local = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.local_rope_theta or cfg.rope_theta,
                                cfg.local_rope_scaling)
        self.rotary_local = local if device is None else local.to(device)

    def layer_rotary(self, layer_id: int) -> RotaryEmbedding:
        return self.rotary_local if self.cfg.window(layer_id) else self.rotary

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

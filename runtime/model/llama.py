"""Decoder-only transformer for Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm), and with
mixture-of-experts MLPs (runtime/model/moe.py) Qwen3-MoE and Mixtral. Gemma 3 subclasses it
(runtime/model/gemma3.py).

Weights use fused projections: `qkv_proj` = [q; k; v] rows and `gate_up_proj` = [gate; up] rows.
Under tensor parallelism each rank builds its share of heads, MLP width and vocabulary
(runtime/model/tensor_parallel.py); with one rank the collectives are no-ops.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.runtime.model.attention import AttentionBackend
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.cpu_decode_step import CpuDecodeStep
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode
from tandem.runtime.model.layers import RMSNorm, RotaryEmbedding
from tandem.runtime.model.moe import SparseMoE
from tandem.runtime.model.ops import CpuOps, TorchOps, TritonOps
from tandem.runtime.model.packed_linear import Weight, fp32_head, head_logits, pack_linears
from tandem.runtime.model.tensor_parallel import SINGLE, TensorParallel, VocabParallelEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # added after the all-reduce, once: inside the row-parallel linear every rank would add it
        self.o_proj_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.o_bias else None
        self.q_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.window = cfg.window(layer_id)  # the layer's sliding window; 0 = every key

    norm_class: type[nn.Module] = RMSNorm  # Gemma 3's (1 + weight) norm in its subclass

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(batch.positions, q, k)
        out = attn.forward(q, k, v, self.layer_id, batch, self.scale, window=self.window)
        return _add_bias(self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size))), self.o_proj_bias)


class MLP(nn.Module):
    ops = TorchOps()

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.act = cfg.hidden_act  # "silu" or "gelu_tanh": which gated activation of the ops
        width = cfg.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.down_proj_bias = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.mlp_bias else None  # as o_proj_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = self.ops.silu_and_mul(gate_up) if self.act == "silu" else self.ops.gelu_tanh_and_mul(gate_up)
        out = self.tp.all_reduce(self.down_proj(act))
        return _add_bias(out, self.down_proj_bias)


def _add_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, tp) if cfg.is_moe_layer(layer_id) else MLP(cfg, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                rotary: RotaryEmbedding, attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch, rotary, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.build_rotary()
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size // tp.size, bias=False))
        self._head_fp32: Weight | None = None  # built from the head's weight on first use (fp32_head)
        self._decode_step: CpuDecodeStep | None = None
        self._decode_step_checked_for: AttentionBackend | None = None  # the backend it was built (or refused) for

    def build_rotary(self, device: torch.device | str | None = None) -> None:
        """The rotary tables (made again on the device once the model leaves the meta device)."""
        cfg = self.cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary if device is None else rotary.to(device)

    def layer_rotary(self, layer_id: int) -> RotaryEmbedding:
        return self.rotary

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def use_ops(self, ops: TorchOps | TritonOps | CpuOps) -> None:
        """Route norms, rotary and the MLPs' activations through `ops` (C++ on the cpu backend,
        Triton kernels with the triton backend)."""
        for module in self.modules():
            if hasattr(type(module), "ops"):
                module.ops = ops

    def hidden_states(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        attn.init_forward(batch)
        x, residual = self.embed(batch.input_ids), None
        step = self._cpu_decode_step(attn) if batch.mode == ForwardMode.DECODE else None
        if step is not None:
            return step.hidden_states(x, batch)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch, self.layer_rotary(i), attn)
        x, _ = self.norm(x, residual)
        return x

    def _cpu_decode_step(self, attn: AttentionBackend) -> CpuDecodeStep | None:
        if self._decode_step_checked_for is not attn:
            self._decode_step, self._decode_step_checked_for = CpuDecodeStep.build(self, attn), attn
        return self._decode_step

    def pack_weights(self) -> int:
        """Every linear but the LM head on packed weights (runtime/model/packed_linear.py); the
        head gets its fp32 copy here, on the thread that runs forward passes. Returns how many."""
        count = pack_linears(self, skip=("lm_head",))
        self._decode_step_checked_for = None  # a step holds the weights it was built on
        self._head_fp32 = fp32_head(self._head_weight())
        return count + 1

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits whatever the model's dtype (SGLang's --enable-fp32-lm-head, always on): bf16
        logits are coarse enough to tie the top tokens, and greedy then picks by rounding. The
        head's GEMM gives a row the same bits in any batch (packed_linear.fp32_head)."""
        if self._head_fp32 is None:
            self._head_fp32 = fp32_head(self._head_weight())
        logits = self.tp.all_gather_last_dim(head_logits(hidden, self._head_fp32))
        cap = self.cfg.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """fp32 logits at `batch.logits_indices`."""
        hidden = self.hidden_states(batch, attn)
        return self.logits(hidden[batch.logits_indices])

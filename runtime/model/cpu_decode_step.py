"""A decode step's decoder layers in one C++ call on CPU (kernels/csrc/decode_layers_cpu.cpp):
what CUDA graphs are to SGLang's decode on a GPU, a step without Python between its ops.

Invariant: it runs the very ops the Python modules run, in their order, on the same weights, so
its hidden states equal the modules' bit for bit; where it cannot (another attention backend or
small ops, tensor parallelism, the C++ ops not built, a layer other than the Llama family's dense
one: Gemma 3's, a mixture of experts) the model keeps its modules, as SGLang
runs eager where a graph does not apply. Weights are read from the modules when a step is built, after
packing (runtime/model/packed_linear.py), and never copied.
"""
from __future__ import annotations


import torch
from torch import nn

from tandem.runtime.envs import envs
from tandem.runtime.model.attention import AttentionBackend, CpuAttnBackend
from tandem.runtime.model.forward_batch import ForwardBatch
from tandem.runtime.model.ops import CpuOps
from tandem.runtime.model.packed_linear import padded_rows, weight_and_like

# a layer's entries, in the order of decode_layers_cpu.cpp's Param enum
LAYER_PARAMS = ("in_norm", "qkv", "qkv_like", "qkv_bias", "q_norm", "k_norm", "o", "o_like", "o_bias",
                "post_norm", "gate_up", "gate_up_like", "gate_up_bias", "down", "down_like", "down_bias")


class CpuDecodeStep:
    def __init__(self, model: nn.Module, attn: CpuAttnBackend) -> None:
        self.attn = attn
        self._model = model
        self._params = [t for layer in model.layers for t in _layer_params(layer)]
        self._num_heads, self._scale = model.layers[0].self_attn.num_heads, model.layers[0].self_attn.scale

    @staticmethod
    def build(model: nn.Module, attn: AttentionBackend) -> CpuDecodeStep | None:
        """A step for `model` under `attn`, or None where the modules must run (see the module doc)."""
        if (type(attn) is not CpuAttnBackend or attn.ops is None or not isinstance(model.norm.ops, CpuOps)
                or model.tp.size != 1 or not envs.CPU_DECODE_STEP.get() or model.cfg.family != "llama"
                or model.cfg.num_experts or model.cfg.hidden_act != "silu"
                or not all(getattr(m, "cpu_decode_step", True) for m in model.modules())):  # int8 linears
            return None
        return CpuDecodeStep(model, attn)

    def hidden_states(self, embedded: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The final-norm hidden states of a decode batch, from its token embeddings."""
        m, attn = self._model, self.attn
        return attn.ops.decode_layers(
            embedded, batch.positions, self._params, attn.kv_pool.k_buffer, attn.kv_pool.v_buffer,
            attn.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, m.rotary.cos_sin,
            m.norm.weight, m.norm.eps, self._scale, self._num_heads, padded_rows(embedded.shape[0]),
            list(m.cfg.layer_windows))


def _layer_params(layer: nn.Module) -> list[torch.Tensor | None]:
    """Every RMSNorm of a model has the config's one eps; o_proj and down_proj have no bias inside
    the linear (theirs is added after the all-reduce), so their third entry is the outer bias."""
    attn, mlp = layer.self_attn, layer.mlp
    params = [layer.input_layernorm.weight, *_linear(attn.qkv_proj),
              _weight(attn.q_norm), _weight(attn.k_norm), *_linear(attn.o_proj)[:2], attn.o_proj_bias,
              layer.post_attention_layernorm.weight, *_linear(mlp.gate_up_proj),
              *_linear(mlp.down_proj)[:2], mlp.down_proj_bias]
    assert len(params) == len(LAYER_PARAMS)
    return params


def _linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(weight, like, bias) as packed_linear.linear takes them: `like` only for MKL's or AMX's packed weights."""
    return *weight_and_like(module.weight), module.bias


def _weight(norm: nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight

"""The mixture-of-experts MLP of Qwen3-MoE and Mixtral: a router picks each token's top-k experts
(kernels/moe_reference.route: softmax in float32, top k, renormalized where the config says),
and the experts run in one fused op of the model's ops (ops.fused_moe: the torch loop over
experts, the C++ op on the cpu backend, the Triton kernel with triton).

Tensor parallelism splits every expert as a dense MLP is split: each rank holds the same experts
with 1/size of their intermediate width (gate_up rows, down columns), the router is replicated,
and the partial outputs are summed by one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.kernels.moe_reference import route
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.ops import TorchOps
from tandem.runtime.model.tensor_parallel import TensorParallel


class Experts(nn.Module):
    """Every expert's weights stacked: gate_up_proj [E, 2I, H] ([gate; up] rows), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))


class SparseMoE(nn.Module):
    ops = TorchOps()  # replaced per model by CausalLM.use_ops

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        return self.tp.all_reduce(out)

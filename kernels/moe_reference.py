"""The torch forms of mixture-of-experts routing and the expert MLPs: what the torch backend serves,
what the C++ and Triton fused-MoE kernels are checked against, and the per-expert loop the MoE
benchmark compares the fused op with. Torch only, no triton.

Layout (runtime/model/moe.py): w13 [E, 2I, H] holds each expert's [gate; up] rows, w2 [E, H, I]
its down projection; topk_ids / topk_weights [T, K] name each token's experts and their weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the top k, renormalized to sum to 1 where the config
    says (Mixtral always, Qwen3-MoE with norm_topk_prob), as transformers routes. Returns
    (float32 weights [T, K], int64 expert ids [T, K])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{id[t, k]}(x[t]) with expert(x) = down(silu(gate x) * up x):
    a Python loop over the experts any token chose, each on its gathered tokens (as transformers'
    experts run). Returns [T, H] in x's dtype, summed in float32."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        rows = pairs // top_k
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, rows, y.float() * weights[pairs, None])
    return out.to(x.dtype)

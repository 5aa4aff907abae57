"""Fused mixture-of-experts MLP in Triton: each expert's tokens grouped, its two GEMMs run as
grouped GEMMs over all experts in one launch each.

1. Alignment (torch ops on the device, no host sync): the (token, k) pairs sorted by expert, each
   expert's run padded to a multiple of BLOCK_M with a sentinel pair id, and every block of BLOCK_M
   sorted pairs labelled with its expert (-1 past the last: those programs exit at once).
2. GEMM 1: a block's pairs read their token's row of x, times the expert's [gate; up] rows -> one
   row of 2I per pair; then SiLU-and-mul (kernels/activation.py).
3. GEMM 2: the pairs' activations times the expert's down rows, scaled by the pair's routing
   weight -> one row of H per pair, summed over k in order.

The torch reference is kernels/moe_reference.fused_moe_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels import activation
from tandem.kernels._checks import check_same_device, check_tensor, dot_precision
from tandem.kernels.moe_reference import fused_moe_ref  # the reference, beside its kernel


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_len]: pair ids t * K + k grouped by expert, each group padded to block_m
    with the sentinel T * K; block_expert [max_len / block_m]: each block's expert, -1 past the
    end). Sized for the worst padding, so nothing waits for the device."""
    pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pair ids by expert, in token order within one
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[flat[order]]
    max_len = pairs + num_experts * (block_m - 1)
    max_len = (max_len + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((max_len,), pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[(padded_end - padded)[flat[order]] + rank] = order
    block_starts = torch.arange(0, max_len, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert


@triton.jit
def _moe_gemm_kernel(A, B, C, SortedIds, BlockExpert, Weights, num_pairs, N, K,
                     stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                     A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """C[pair] = A[pair // A_ROW_DIV] @ B[expert].T (times the pair's weight), for a block of pairs
    of one expert and BLOCK_N output columns."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(SortedIds + offs_m)
    valid = ids < num_pairs
    rows = tl.where(valid, ids // A_ROW_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        a = tl.load(A + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(B + expert * stride_be + offs_n[None, :] * stride_bn + ks[:, None] * stride_bk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(Weights + ids, mask=valid, other=0.0)[:, None]
    tl.store(C + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
             mask=valid[:, None] & mask_n[None, :])


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
          weights: torch.Tensor | None, a_row_div: int, block_m: int) -> None:
    n, k = b.shape[1], b.shape[2]
    block_n, block_k = 32, 32
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, b, out, sorted_ids, block_expert, weights if weights is not None else out,
                           out.shape[0], n, k, a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
                           A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=block_k, PRECISION=dot_precision(a.dtype), num_warps=4)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] ([gate; up] rows); w2 [E, H, I]; topk_weights / topk_ids [T, K].
    Returns sum_k weight * down(silu(gate x) * up x), [T, H] in x's dtype."""
    check_tensor("x", x, 2)
    check_tensor("w13", w13, 3)
    check_tensor("w2", w2, 3)
    check_same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    tokens, hidden = x.shape
    experts, width2, _ = w13.shape
    if w13.shape[2] != hidden or w2.shape != (experts, hidden, width2 // 2) or width2 % 2:
        raise ValueError(f"w13 must be [E, 2I, {hidden}] and w2 [E, {hidden}, I]; got {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids and topk_weights must both be [{tokens}, K]; got {tuple(topk_ids.shape)}, "
                         f"{tuple(topk_weights.shape)}")
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    sorted_ids, block_expert = align_block_size(topk_ids, experts, block_m)
    gate_up = torch.empty(tokens * top_k, width2, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, sorted_ids, block_expert, None, top_k, block_m)
    act = activation.silu_and_mul(gate_up)
    down = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _gemm(act, w2, down, sorted_ids, block_expert, topk_weights.reshape(-1).float().contiguous(), 1, block_m)
    return down.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


__all__ = ["align_block_size", "fused_moe", "fused_moe_ref"]

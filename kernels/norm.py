"""RMSNorm and fused residual-add + RMSNorm, one row per program.

Rounding follows `runtime.model.layers.RMSNorm` step by step (sum rounded to the input dtype,
normalized value rounded before the weight multiply) so fp16 results match the torch path bit
for bit in most elements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import check_dim, check_same_device, check_same_dtype, check_tensor, next_pow2
from tandem.kernels import reference

MAX_HIDDEN = 65536


# the references are the torch path that serves: a kernel tested against them matches it
rmsnorm_ref = reference.rmsnorm
fused_add_rmsnorm_ref = reference.add_rmsnorm


@triton.jit
def _rmsnorm_kernel(X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, eps,
                    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ROut + row * stride_ro + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (normed * w).to(Out.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """View as [rows, hidden]; copies only when the leading dims cannot be flattened."""
    check_tensor(name, t, t.dim())
    return t.reshape(-1, t.shape[-1])


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, res_out: torch.Tensor | None) -> None:
    rows, n = x.shape
    if n > MAX_HIDDEN:
        raise ValueError(f"rmsnorm supports a hidden size up to {MAX_HIDDEN}, got {n}")
    if rows == 0:
        return
    block = next_pow2(n)
    r = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    _rmsnorm_kernel[(rows,)](x, r, weight, out, ro, x.stride(0), r.stride(0), out.stride(0), ro.stride(0), eps,
                             N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
                             num_warps=min(16, max(1, block // 256)))


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor("weight", weight, 1)
    check_dim("weight", weight, 0, x.shape[-1])
    check_same_device(x=x, weight=weight)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. Returns a new tensor in x's dtype and shape."""
    x2 = _rows("x", x)
    _check_weight(x, weight)
    out = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    _launch(x2, None, weight, eps, out, None)
    return out.view(x.shape)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual) as new tensors; inputs are left untouched."""
    x2, r2 = _rows("x", x), _rows("residual", residual)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have the same shape")
    check_same_dtype(x=x, residual=residual)
    _check_weight(x, weight)
    out = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    res_out = torch.empty_like(x2)
    _launch(x2, r2, weight, eps, out, res_out)
    return out.view(x.shape), res_out.view(x.shape)

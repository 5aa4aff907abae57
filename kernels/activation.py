"""SiLU-and-mul: out = silu(gate) * up for gate_up = [gate | up] along the last dim."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import check_same_device, check_tensor, next_pow2
from tandem.kernels import reference


silu_and_mul_ref = reference.silu_and_mul  # the torch path that serves


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + N + offs, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    # round silu to the input dtype before the multiply, as the two torch ops do
    act = (g32 * tl.sigmoid(g32)).to(gate.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * I] -> [..., I] in the same dtype."""
    check_tensor("gate_up", gate_up, gate_up.dim())
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up last dim must be even, got shape {tuple(gate_up.shape)}")
    check_same_device(gate_up=gate_up)
    x = gate_up.reshape(-1, gate_up.shape[-1])
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0] and n:
        block = min(1024, next_pow2(n))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), N=n,
                                                                 BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)

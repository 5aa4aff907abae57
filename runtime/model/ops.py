"""The small fused ops behind one interface: torch (the reference), C++ on CPU (kernels/csrc), Triton
kernels with the triton backend."""
from __future__ import annotations

import torch

from tandem.kernels import moe_reference, reference


class TorchOps:
    """The torch forms (kernels/reference.py): the reference every other path is checked against.
    Gemma's norm and GELU-tanh gate run as these torch forms under every backend."""
    name = "torch"
    rmsnorm = staticmethod(reference.rmsnorm)
    rotary = staticmethod(reference.rotary)
    silu_and_mul = staticmethod(reference.silu_and_mul)
    gelu_tanh_and_mul = staticmethod(reference.gelu_tanh_and_mul)
    gemma_rmsnorm = staticmethod(reference.gemma_rmsnorm)
    fused_moe = staticmethod(moe_reference.fused_moe_ref)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.rmsnorm(residual, weight, eps), residual


class TritonOps:
    name = "triton"
    gelu_tanh_and_mul = staticmethod(reference.gelu_tanh_and_mul)
    gemma_rmsnorm = staticmethod(reference.gemma_rmsnorm)

    def __init__(self) -> None:
        from tandem.kernels import activation, fused_moe, norm, rotary  # lazy: imports triton

        self._norm, self._rotary, self._act, self._moe = norm, rotary, activation, fused_moe

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        return self._moe.fused_moe(x, w13, w2, topk_weights, topk_ids)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._norm.fused_add_rmsnorm(x, residual, weight, eps)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary.apply_rotary_(positions, q, k, cos_sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act.silu_and_mul(gate_up)


class CpuOps:
    """The C++ ops of kernels/csrc/elementwise_cpu.cpp: TorchOps' rounding, one pass per op; the
    mixture-of-experts MLP in one op (kernels/csrc/fused_moe_cpu.cpp)."""

    name = "cpu"
    gelu_tanh_and_mul = staticmethod(reference.gelu_tanh_and_mul)
    gemma_rmsnorm = staticmethod(reference.gemma_rmsnorm)

    def __init__(self, ops: object) -> None:
        self._ops = ops

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops.add_rmsnorm(x, None, weight, eps)[0]

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        out, summed = self._ops.add_rmsnorm(x, residual, weight, eps)  # the op returns a list
        return out, summed

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ops.rotary_(positions, q, k, cos_sin)  # in place, like the Triton kernel
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops.silu_and_mul(gate_up)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        return self._ops.fused_moe(x, w13, w2, topk_weights, topk_ids)


def create_ops(name: str) -> TorchOps | TritonOps | CpuOps:
    if name == "triton":
        return TritonOps()
    if name == "cpu":
        from tandem.kernels.cpu_ops import load_cpu_ops

        ops = load_cpu_ops()
        if ops is not None:  # without a toolchain the torch ops stay (logged by load_cpu_ops)
            return CpuOps(ops)
    return TorchOps()

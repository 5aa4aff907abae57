"""Argument checks shared by the kernel launchers: fail on the host with a clear message
instead of letting a kernel read out of bounds or silently compute garbage."""
from __future__ import annotations

import torch

from tandem.kernels.interpreter import triton_interpreting

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)  # KV pools of --kv-cache-dtype
KV_DTYPES = FLOAT_DTYPES + FP8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
                 last_contiguous: bool = True) -> None:
    """Rank and dtype; kernels index the last dim with stride 1, so that must hold."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, dtypes))}")
    if last_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last dim, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")
    if next(iter(devices.values())).type != "cuda" and not triton_interpreting():
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 to run on CPU")


def check_dim(name: str, t: torch.Tensor, dim: int, size: int) -> None:
    if t.shape[dim] != size:
        raise ValueError(f"{name} dim {dim} must be {size}, got shape {tuple(t.shape)}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"dtypes must match: {dtypes}")


def check_kv_pool_dtype(model_dtype: torch.dtype, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    """A KV pool holds the model's dtype, or fp8 that kernels widen as they read."""
    check_same_dtype(k_buffer=k_buffer, v_buffer=v_buffer)
    if k_buffer.dtype != model_dtype and k_buffer.dtype not in FP8_DTYPES:
        raise TypeError(f"the KV pool holds {k_buffer.dtype}: it must hold {model_dtype} (the model's) or an fp8 dtype")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    # tl.dot defaults to tf32 for fp32 inputs; fp32 callers expect full precision
    return "ieee" if dtype == torch.float32 else "tf32"

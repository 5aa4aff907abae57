"""CPU ops written in C++ (kernels/csrc), compiled on first use by torch's cpp_extension and
registered through torch.library as `torch.ops.tandem_cpu.*`.

Compiled for the CPU it runs on (-march=native), so the build is cached per source and per CPU
flag set. A machine without a C++ toolchain gets None from `load_cpu_ops` with the reason
logged, and callers keep their torch path: the op is a speed-up, never a requirement.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os

logger = logging.getLogger(__name__)

_SOURCES = ("amx_linear_cpu.cpp", "decode_attention_cpu.cpp", "decode_layers_cpu.cpp", "elementwise_cpu.cpp",
            "fused_moe_cpu.cpp", "gguf_linear_cpu.cpp", "greedy_cpu.cpp")
# hashed with the sources: a change rebuilds
_HEADERS = ("amx_common.h", "attention_amx.h", "attention_amx_pack.h", "cpu_dtype.h", "decode_attention_common.h",
            "decode_attention_avx512.h",
            "gguf_amx_bf16.h", "gguf_units.h")
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-std=c++17", "-ffast-math"]


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def _build_name(paths: list[str]) -> str:
    digest = hashlib.sha256(" ".join(sorted(cpu_flags()) + _CFLAGS).encode())
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"tandem_cpu_ops_{digest.hexdigest()[:16]}"


@functools.cache
def load_cpu_ops() -> object | None:
    """`torch.ops.tandem_cpu` once the library is built and loaded; None (logged) when it cannot be."""
    import torch
    from torch.utils import cpp_extension

    csrc = os.path.join(os.path.dirname(__file__), "csrc")
    sources = [os.path.join(csrc, name) for name in _SOURCES]
    headers = [os.path.join(csrc, name) for name in _HEADERS]
    try:
        cpp_extension.load(name=_build_name(sources + headers), sources=sources, extra_cflags=_CFLAGS,
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a broken toolchain: keep the torch path
        logger.warning("CPU ops not built (%s: %s); the model keeps torch's ops (gather + SDPA for decode)",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    return torch.ops.tandem_cpu

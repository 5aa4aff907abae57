"""Fixtures shared by the kernel tests."""
from __future__ import annotations

import pytest

from tandem.kernels.cpu_ops import load_cpu_ops


@pytest.fixture(scope="session")
def amx_ops():
    """The C++ CPU ops where the process may use AMX-BF16; the AMX tests skip elsewhere (a hardware
    condition: on such CPUs the AMX kernels never run, and the paths that do are tested)."""
    built = load_cpu_ops()
    assert built is not None, "the CPU ops did not build: see the warning logged by load_cpu_ops"
    if not built.amx_available():
        pytest.skip("this CPU (or kernel) gives no AMX-BF16 to the process: the AMX kernels never run here")
    return built

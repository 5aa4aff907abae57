"""Whether Triton kernels run in Triton's interpreter (its own TRITON_INTERPRET switch, not a
TANDEM_ one), on CPU tensors. Torch-free, so the front end may ask it."""
from __future__ import annotations

import os


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

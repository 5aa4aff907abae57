"""Session-wide test setup: Triton runs in its interpreter on machines without a GPU."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must be set before triton is first imported anywhere in the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

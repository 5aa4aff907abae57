"""GrammarMask: the token mask of one step's constrained rows.

The scheduler thread fills it from each request's matcher once the previous step's tokens
have been accepted, which, under overlap, is while this step's forward runs on the device. The
forward worker waits for it only just before sampling, applies it (a Triton kernel on GPUs,
torch on CPU) and samples; output logprobs are of the masked logits (a masked token reads
float32's minimum), as SGLang's.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

_FILL_TIMEOUT_S = 600.0  # the scheduler fills within a step; this only turns a bug into an error


class GrammarMask:
    def __init__(self, sample_indices: list[int]) -> None:
        self.sample_indices = sample_indices  # rows of the step's sampling batch that are constrained
        self._ready = threading.Event()
        self._bitmask: torch.Tensor | None = None
        self._error: BaseException | None = None

    def fill(self, matchers: list[Any], backend: Any, device: torch.device) -> None:
        """Scheduler thread: one bitmask row per constrained row (GrammarBackend.fill_bitmask)."""
        try:
            bitmask = backend.bitmask_buffer(len(matchers))
            backend.fill_bitmask(matchers, bitmask)
            self._bitmask = bitmask.to(device, non_blocking=True)
        except BaseException as exc:  # the worker must never wait forever
            self._error = exc
            raise
        finally:
            self._ready.set()

    def apply(self, logits: torch.Tensor, logit_rows: list[int] | None = None) -> torch.Tensor:
        """Worker thread: a masked copy of `logits` (output logprobs are of it too, as SGLang's).
        `logit_rows`: where each constrained row sits in `logits` (default: `sample_indices`)."""
        if not self._ready.wait(_FILL_TIMEOUT_S):
            raise RuntimeError("the grammar mask of this step was never filled")
        if self._error is not None:
            raise RuntimeError(f"filling the grammar mask failed: {self._error}")
        masked = logits.clone()
        rows = torch.tensor(self.sample_indices if logit_rows is None else logit_rows, dtype=torch.int64,
                            device=logits.device)
        bitmask = self._bitmask
        if logits.is_cuda:
            from tandem.kernels import token_bitmask  # lazy: imports triton, which CPU installs lack

            token_bitmask.apply_token_bitmask(masked, bitmask, rows)
        else:
            from tandem.kernels.reference import apply_token_bitmask_ref

            apply_token_bitmask_ref(masked, bitmask, rows)
        return masked

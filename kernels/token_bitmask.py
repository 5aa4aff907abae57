"""Apply a packed token bitmask to logits: disallowed tokens get -inf (guided decoding).

`bitmask` is int32 [B, ceil(V / 32)] as xgrammar fills it: bit j of word w allows token
32 * w + j. `rows[i]` is the logits row that mask row i applies to; rows not listed are left
alone, so constrained and unconstrained requests share a batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import INDEX_DTYPES, check_same_device, check_tensor


@triton.jit
def _apply_token_bitmask_kernel(Logits, Bitmask, Rows, stride_l, stride_b, vocab,
                                BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    row = tl.load(Rows + i).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab
    words = tl.load(Bitmask + i * stride_b + offs // 32, mask=in_vocab, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(Logits + row * stride_l + offs, float("-inf"), mask=in_vocab & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, block: int = 1024) -> None:
    """In place. logits: [N, V] float; bitmask: [B, ceil(V/32)] int32; rows: [B] indices into logits."""
    check_tensor("logits", logits, 2)
    check_tensor("bitmask", bitmask, 2, (torch.int32,))
    check_tensor("rows", rows, 1, INDEX_DTYPES, last_contiguous=False)
    check_same_device(logits=logits, bitmask=bitmask, rows=rows)
    vocab = logits.shape[1]
    if bitmask.shape[0] != rows.shape[0] or bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover rows {tuple(rows.shape)} x vocab {vocab}")
    if rows.numel() == 0:
        return
    grid = (rows.shape[0], triton.cdiv(vocab, block))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows.contiguous(), logits.stride(0), bitmask.stride(0), vocab,
                                      BLOCK=block)

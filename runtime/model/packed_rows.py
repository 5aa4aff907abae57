"""Rows written straight into an AMX-packed bf16 weight (packed_linear.AmxPackedWeight), for
weight updates: each row block is converted to bf16 and laid out in amx_pack's tile order in one
copy, with no plain [out, in] copy of the whole weight and no second pass to pack it.

amx_pack's layout, [out/16, in/32, 16, 32] bf16, is [tile of 16 output rows, step of 32 inputs,
pair p of inputs, row r] with the two bf16 of inputs (2p, 2p + 1) side by side: read as int32 (one
int32 a pair), it is a transpose of each tile's [16 rows, in/2 pairs] block.

Invariant: after `write_rows(packed, first, rows)`, `packed` equals, bit for bit, amx_pack of
the plain weight it held with rows first .. first + len(rows) replaced by `rows` in bf16.
"""
from __future__ import annotations

import torch

TILE_ROWS = 16  # output rows a tile holds (kernels/csrc/amx_linear_cpu.cpp's kTileRows)
STEP_K = 32  # inputs a tile step holds (its kStepK)


def write_rows(packed: torch.Tensor, first: int, rows: torch.Tensor) -> None:
    """Rows first .. first + len(rows) of the packed weight `packed` become `rows` ([n, in], any
    float dtype; rounded to bf16 as `.to(torch.bfloat16)` rounds)."""
    tiles, steps = packed.shape[0], packed.shape[1]
    if rows.dim() != 2 or rows.shape[1] != steps * STEP_K or not 0 <= first <= first + rows.shape[0] <= tiles * TILE_ROWS:
        raise ValueError(f"rows {tuple(rows.shape)} at {first} do not fit a packed [{tiles * TILE_ROWS}, "
                         f"{steps * STEP_K}] weight")
    dst = packed.view(torch.int32).view(tiles, steps, STEP_K // 2, TILE_ROWS)  # [tile, step, pair, row]
    pairs = rows.to(torch.bfloat16).contiguous().view(torch.int32)  # [n, in / 2]: one int32 a pair
    row, end = first, first + rows.shape[0]
    while row < end:
        tile, offset = divmod(row, TILE_ROWS)
        if offset == 0 and end - row >= TILE_ROWS:  # whole tiles: one transposing copy
            count = (end - row) // TILE_ROWS
            block = pairs[row - first: row - first + count * TILE_ROWS]
            dst[tile: tile + count].copy_(block.view(count, TILE_ROWS, steps, STEP_K // 2).permute(0, 2, 3, 1))
            row += count * TILE_ROWS
        else:  # part of one tile
            take = min(TILE_ROWS - offset, end - row)
            block = pairs[row - first: row - first + take]
            dst[tile, :, :, offset: offset + take].copy_(block.view(take, steps, STEP_K // 2).permute(1, 2, 0))
            row += take

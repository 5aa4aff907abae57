"""packed_rows.write_rows: rows written into an AMX-packed weight give, bit for bit, what
amx_pack gives for the plain weight with those rows replaced, at tile boundaries and inside one."""
from __future__ import annotations

import pytest
import torch

from tandem.runtime.model.packed_linear import amx_ops
from tandem.runtime.model.packed_rows import write_rows

needs_amx = pytest.mark.skipif(amx_ops() is None, reason="amx_pack is built only on CPUs with AMX-BF16")


@needs_amx
@pytest.mark.parametrize("first, count", [(0, 96), (16, 32), (5, 40), (3, 7), (90, 6), (0, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_rows_equal_amx_pack_of_the_plain_weight(first, count, dtype):
    torch.manual_seed(0)
    old, rows = torch.randn(96, 64).to(torch.bfloat16), torch.randn(count, 64, dtype=dtype)
    packed = amx_ops().amx_pack(old)
    write_rows(packed, first, rows)
    want = old.clone()
    want[first:first + count] = rows.to(torch.bfloat16)
    assert torch.equal(packed, amx_ops().amx_pack(want))


@needs_amx
def test_rows_that_do_not_fit_are_refused():
    packed = amx_ops().amx_pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        write_rows(packed, 20, torch.zeros(16, 64))
    with pytest.raises(ValueError, match="do not fit"):
        write_rows(packed, 0, torch.zeros(4, 32))

"""KV pool store kernel vs its torch reference (Triton interpreter on CPU)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tandem.kernels.kv_store import store_kv, store_kv_ref


@pytest.fixture(autouse=True)
def _default_device() -> Iterator[None]:
    """Kernels run on the GPU when there is one, else on CPU under the interpreter."""
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_only_target_slots(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    kv_heads, head_dim, tokens = 2, 64, 5
    kv = torch.randn(tokens, 2 * kv_heads * head_dim, dtype=dtype)
    k, v = (t.view(tokens, kv_heads, head_dim) for t in kv.chunk(2, dim=-1))  # strided views, as from qkv
    loc = torch.tensor([7, 1, 12, 3, 4])
    bufs = [torch.randn(16, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    ref = [b.clone() for b in bufs]
    store_kv(bufs[0], bufs[1], loc, k, v)
    store_kv_ref(ref[0], ref[1], loc, k, v)
    assert torch.equal(bufs[0], ref[0]) and torch.equal(bufs[1], ref[1])


def test_store_kv_checks_arguments() -> None:
    buf = torch.zeros(8, 2, 16)
    with pytest.raises(TypeError, match="dtypes must match"):
        store_kv(buf, buf, torch.tensor([1]), torch.zeros(1, 2, 16, dtype=torch.float16),
                 torch.zeros(1, 2, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="loc dim 0 must be 2"):
        store_kv(buf, buf, torch.tensor([1]), torch.zeros(2, 2, 16), torch.zeros(2, 2, 16))
    with pytest.raises(ValueError, match="k_buffer dim 1 must be 3"):
        store_kv(buf, buf, torch.tensor([1]), torch.zeros(1, 3, 16), torch.zeros(1, 3, 16))

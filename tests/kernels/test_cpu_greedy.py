"""The C++ greedy op (kernels/csrc/greedy_cpu.cpp): each row's first maximum, read in the logits'
own dtype, equal to argmax of the float32 widening: ties, maxima at block edges and in the
last partial block, rows of -inf, rows with a stride."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.cpu_ops import load_cpu_ops

pytestmark = pytest.mark.timeout(300)  # the first call compiles the ops (~20 s), cached afterwards

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops():
    built = load_cpu_ops()
    assert built is not None, "the CPU ops did not build: see the warning logged by load_cpu_ops"
    return built


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 512, 513, 49152, 50257])
def test_first_maximum_of_random_rows(ops, dtype, vocab):
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    assert torch.equal(ops.greedy_ids(logits), logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_edges_and_masked_rows(ops, dtype):
    vocab = 2000  # blocks of 512: the last one partial
    logits = torch.zeros(7, vocab, dtype=dtype) - 3
    logits[0, [700, 100, 1500]] = 5  # a tie across blocks: the first wins
    logits[1, [511, 512]] = 5  # a tie across a block edge
    logits[2, vocab - 1] = 5  # in the last, partial block
    logits[3] = float("-inf")  # every token masked: torch's argmax says 0
    logits[4] = float("-inf")
    logits[4, 1999] = -1e4  # one survivor after a mask
    logits[5, 1024] = float("inf")
    logits[6, 3] = -2.5  # every logit negative
    want = logits.float().argmax(-1)
    assert want.tolist() == [100, 511, 1999, 0, 1999, 1024, 3]
    assert torch.equal(ops.greedy_ids(logits), want)


def test_strided_rows(ops):
    wide = torch.randn(5, 3000, generator=torch.Generator().manual_seed(1))
    logits = wide[:, 100:2100]  # rows 3000 apart
    assert torch.equal(ops.greedy_ids(logits), logits.argmax(-1))


def test_bad_input_is_refused(ops):
    with pytest.raises(RuntimeError, match="logits"):
        ops.greedy_ids(torch.zeros(4))
    with pytest.raises(RuntimeError, match="logits"):
        ops.greedy_ids(torch.zeros(4, 6).t())
    with pytest.raises(RuntimeError, match="dtype"):
        ops.greedy_ids(torch.zeros(2, 3, dtype=torch.int32))


@pytest.mark.parametrize("vocab", [1, 15, 17, 49152])
def test_logsumexp_rows_is_torchs_and_gives_a_row_the_same_bits_in_any_batch(ops, vocab):
    logits = torch.randn(40, vocab, generator=torch.Generator().manual_seed(vocab)) * 5
    batched = ops.logsumexp_rows(logits)
    torch.testing.assert_close(batched, torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-5)  # another order
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert all(torch.equal(ops.logsumexp_rows(logits[i:i + 1])[0], batched[i]) for i in range(40))
    finally:
        torch.set_num_threads(threads)


def test_logsumexp_rows_of_a_masked_row_is_minus_infinity(ops):
    row = torch.full((1, 8), float("-inf"))
    assert ops.logsumexp_rows(row).item() == float("-inf")

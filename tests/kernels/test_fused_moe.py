"""The fused mixture-of-experts kernels against the torch loop over experts (kernels/moe_reference.py):
the C++ CPU op (kernels/csrc/fused_moe_cpu.cpp) in every float dtype, giving a token the same bits
alone, in any batch and at any thread count; the Triton kernel (kernels/fused_moe.py) under the
interpreter in fp32 and fp16 (the interpreter's bf16 is broken); and the routing."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.cpu_ops import load_cpu_ops
from tandem.kernels.moe_reference import fused_moe_ref, route

pytestmark = pytest.mark.timeout(300)  # the first call may compile the CPU ops


@pytest.fixture(scope="module")
def ops():
    built = load_cpu_ops()
    assert built is not None, "the CPU ops did not build: see the warning logged by load_cpu_ops"
    return built


def _case(tokens: int, hidden: int, width: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0,
          skewed: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=g) * width ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    if skewed:  # most tokens to expert 0, some experts to none
        logits[:, 0] += 4
        logits[:, experts // 2:] -= 8
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def _reference(x, w13, w2, weights, ids) -> torch.Tensor:
    return fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)


# fp32: summation order only; bf16/fp16: the output's rounding (the op keeps fp32 in between)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("tokens, hidden, width, experts, top_k", [
    (1, 64, 32, 8, 2), (37, 64, 48, 8, 2), (5, 96, 40, 4, 4), (64, 128, 64, 16, 1), (9, 33, 17, 3, 2)])
def test_cpu_op_matches_the_loop_over_experts(ops, dtype, tol, tokens, hidden, width, experts, top_k):
    x, w13, w2, weights, ids = _case(tokens, hidden, width, experts, top_k, dtype)
    out = ops.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    ref = _reference(x, w13, w2, weights, ids)
    assert (out.double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_cpu_op_with_experts_nobody_chose(ops):
    x, w13, w2, weights, ids = _case(40, 64, 32, 8, 2, torch.float32, skewed=True)
    assert len(ids.unique()) < 8
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, weights, ids).double(),
                               _reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_gives_a_token_the_same_bits_alone_in_any_batch_and_thread_count(ops, dtype):
    x, w13, w2, weights, ids = _case(50, 128, 64, 8, 2, dtype, seed=3)
    batched = ops.fused_moe(x, w13, w2, weights, ids)
    for t in (0, 17, 49):
        alone = ops.fused_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])
        assert torch.equal(alone[0], batched[t])
    picked = torch.tensor([3, 40, 7])
    assert torch.equal(ops.fused_moe(x[picked], w13, w2, weights[picked], ids[picked]), batched[picked])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.fused_moe(x, w13, w2, weights, ids), batched)
    finally:
        torch.set_num_threads(threads)


def test_cpu_op_refuses_bad_arguments(ops):
    x, w13, w2, weights, ids = _case(4, 64, 32, 8, 2, torch.float32)
    with pytest.raises(RuntimeError, match="outside"):
        ops.fused_moe(x, w13, w2, weights, ids + 8)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.fused_moe(x.double(), w13, w2, weights, ids)
    with pytest.raises(RuntimeError, match=r"w13 must be \[E, 2I, 64\]"):
        ops.fused_moe(x, w13[:, :, :32], w2, weights, ids)
    with pytest.raises(RuntimeError, match="topk_ids"):
        ops.fused_moe(x, w13, w2, weights, ids.int())


def test_empty_batch(ops):
    x, w13, w2, weights, ids = _case(3, 64, 32, 8, 2, torch.float32)
    assert ops.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 64)


def test_route_renormalizes_only_when_asked():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs = torch.softmax(logits, -1)
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights, probs[:, [1, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(1)) and weights.dtype == torch.float32


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("tokens, experts, top_k, skewed", [(1, 8, 2, False), (37, 8, 2, False), (40, 8, 2, True),
                                                            (20, 4, 4, False)])
def test_triton_kernel_matches_the_loop_over_experts(dtype, tol, tokens, experts, top_k, skewed):
    from tandem.kernels.fused_moe import fused_moe

    x, w13, w2, weights, ids = _case(tokens, 64, 48, experts, top_k, dtype, skewed=skewed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        out = fused_moe(*(t.to(torch.get_default_device()) for t in (x, w13, w2, weights, ids)))
    ref = _reference(x, w13, w2, weights, ids)
    assert (out.cpu().double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_triton_alignment_groups_pairs_by_expert_in_padded_blocks():
    from tandem.kernels.fused_moe import align_block_size

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, block_expert = align_block_size(ids, 4, block_m=4)
    sentinel = ids.numel()
    # pair t * 2 + k: expert 0 has pairs 1, 4; expert 1 pair 3; expert 2 pairs 0, 2, 5; expert 3 none
    assert sorted_ids[:12].tolist() == [1, 4, sentinel, sentinel, 3, sentinel, sentinel, sentinel,
                                        0, 2, 5, sentinel]
    assert block_expert[:3].tolist() == [0, 1, 2] and (block_expert[3:] == -1).all()
    assert (sorted_ids[12:] == sentinel).all()

"""The C++ paged decode attention op (kernels/csrc) against attention computed per request in
float64 from the same pool: scattered slots, GQA groups, lengths from 1, every pool dtype; and
the build's file lists against what is in csrc and what a wheel ships."""
from __future__ import annotations

import fnmatch
import math
import tomllib
from pathlib import Path

import pytest
import torch

from tandem.kernels import cpu_ops
from tandem.kernels.cpu_ops import load_cpu_ops

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)  # the first call compiles the op (~15 s), cached afterwards


@pytest.fixture(scope="module")
def ops():
    built = load_cpu_ops()
    assert built is not None, "the CPU op did not build: see the warning logged by load_cpu_ops"
    return built


def reference(q, k_pool, v_pool, req_to_token, rows, lens, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_pool.shape[1]
    for b, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        slots = req_to_token[row, :n]
        k = k_pool[slots].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_pool[slots].double().repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", w, v)
    return out


def make_case(dtype, bs, hq, hkv, d, lens, seed=0, kv_dtype=None):
    g = torch.Generator().manual_seed(seed)
    pool_size = sum(lens) + 50
    k_pool = torch.randn(pool_size, hkv, d, generator=g).to(kv_dtype or dtype)
    v_pool = torch.randn(pool_size, hkv, d, generator=g).to(kv_dtype or dtype)
    req_to_token = torch.zeros(bs + 3, max(lens) + 7, dtype=torch.int64)  # rows wider than any sequence
    rows = torch.randperm(bs + 3, generator=g)[:bs]
    slots = torch.randperm(pool_size - 1, generator=g) + 1  # scattered, never slot 0
    start = 0
    for row, n in zip(rows.tolist(), lens):
        req_to_token[row, :n] = slots[start:start + n]
        start += n
    q = torch.randn(bs, hq, d, generator=g).to(dtype)
    return q, k_pool, v_pool, req_to_token, rows, torch.tensor(lens, dtype=torch.int64)


# fp32 differs from float64 only in summation order; bf16/fp16 inputs are converted exactly to
# fp32 inside the op, so the tolerance covers the rounding of the output back to 16 bits (2^-8 for bf16)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (9, 3), (8, 1), (14, 2), (10, 1)])  # groups 1, 3, 8, 7, 10
@pytest.mark.parametrize("d", [32, 64, 128])  # 64 and 128 take the unrolled instantiations
def test_matches_per_request_attention(ops, dtype, tol, hq, hkv, d):
    lens = [1, 2, 17, 64, 129, 5]
    q, k_pool, v_pool, r2t, rows, seq_lens = make_case(dtype, len(lens), hq, hkv, d, lens)
    scale = 1 / math.sqrt(d)
    out = ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(q, k_pool, v_pool, r2t, rows, seq_lens, scale)
    assert (out.double() - ref).abs().max().item() < tol


# an fp8 pool (--kv-cache-dtype) is read exactly (every fp8 value is a float32), so the
# op still differs from float64 on the same pool only by float32 sums and q's output rounding
@pytest.mark.parametrize("kv_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (14, 2, 128), (6, 2, 32)])  # AVX-512 paths and the portable one
def test_fp8_pool_matches_attention_over_the_same_pool(ops, kv_dtype, dtype, tol, hq, hkv, d):
    lens = [1, 17, 129, 40]
    q, k_pool, v_pool, r2t, rows, seq_lens = make_case(dtype, len(lens), hq, hkv, d, lens, kv_dtype=kv_dtype)
    out = ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 1 / math.sqrt(d))
    assert out.dtype == dtype
    ref = reference(q, k_pool, v_pool, r2t, rows, seq_lens, 1 / math.sqrt(d))
    assert (out.double() - ref).abs().max().item() < tol


def fp8_codes(kv_dtype: torch.dtype) -> torch.Tensor:
    """All 256 codes of an fp8 format, in code order."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype)


def test_every_fp8_code_widens_to_its_value(ops):
    """All 256 codes of each format (e4m3's NaN aside) as a one-token pool: attention returns V itself."""
    for kv_dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
        codes = fp8_codes(kv_dtype)
        values = codes.float()
        finite = values.isfinite()
        v_pool = torch.zeros(2, 1, 256, dtype=kv_dtype)
        v_pool[1, 0] = torch.where(finite, codes.float(), 0.0).to(kv_dtype)
        k_pool = torch.zeros(2, 1, 256, dtype=kv_dtype)
        r2t = torch.tensor([[1]])
        for d in (64, 32):  # an AVX-512 head dim and a portable one, each reading every code once
            for start in range(0, 256, d):
                out = ops.decode_attention(torch.ones(1, 1, d), k_pool[:, :, start:start + d].contiguous(),
                                           v_pool[:, :, start:start + d].contiguous(), r2t, torch.tensor([0]),
                                           torch.tensor([1]), 1.0)
                expect = torch.where(finite, values, 0.0)[start:start + d]
                assert torch.equal(out[0, 0], expect), (kv_dtype, d, start)


def test_every_fp8_code_scores_as_its_value(ops):
    """Each finite code as a key's first element beside an all-zero key: with q one-hot on that
    element, the first key's softmax weight is sigmoid(code * scale), down to e4m3's subnormals
    (the AVX-512 path reads e4m3 keys 2^8 too small and puts the 2^8 back into the scale)."""
    scale = 0.125
    for kv_dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
        codes = fp8_codes(kv_dtype)
        values = codes.double()[codes.float().isfinite()]
        n = len(values)
        for d in (64, 32):  # an AVX-512 head dim and a portable one
            k_pool = torch.zeros(n + 1, 1, d)
            k_pool[:n, 0, 0] = values.float()
            v_pool = torch.zeros(n + 1, 1, d)
            v_pool[:n, 0, 0] = 1.0  # the output's first element is the first key's weight
            r2t = torch.stack([torch.arange(n), torch.full((n,), n)], dim=1)
            q = torch.zeros(n, 1, d)
            q[:, 0, 0] = 1.0
            out = ops.decode_attention(q, k_pool.to(kv_dtype), v_pool.to(kv_dtype), r2t, torch.arange(n),
                                       torch.full((n,), 2), scale)
            expect = torch.sigmoid(values * scale)
            assert (out[:, 0, 0].double() - expect).abs().max().item() < 1e-6, (kv_dtype, d)


def test_a_pool_of_another_dtype_is_refused(ops):
    q, k_pool, v_pool, r2t, rows, seq_lens = make_case(torch.bfloat16, 2, 6, 2, 16, [3, 4], kv_dtype=torch.float16)
    with pytest.raises(RuntimeError, match="must hold q's dtype"):
        ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.25)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_query_may_be_a_view_into_the_fused_qkv_output(ops, dtype, tol):
    """The model passes q as a slice of each token's [q; k; v] row: read in place, same result."""
    lens = [300, 1, 40]
    q, k_pool, v_pool, r2t, rows, seq_lens = make_case(dtype, len(lens), 9, 3, 64, lens, seed=5)
    qkv = torch.cat([q.reshape(len(lens), -1), torch.randn(len(lens), 2 * 3 * 64).to(dtype)], dim=1)
    q_view = qkv[:, :9 * 64].view(len(lens), 9, 64)
    assert not q_view.is_contiguous()
    out = ops.decode_attention(q_view, k_pool, v_pool, r2t, rows, seq_lens, 0.125)
    assert torch.equal(out, ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.125))
    assert (out.double() - reference(q, k_pool, v_pool, r2t, rows, seq_lens, 0.125)).abs().max().item() < tol


def test_reads_only_the_named_slots(ops):
    """Garbage everywhere outside the requests' slots changes nothing."""
    lens = [7, 33]
    q, k_pool, v_pool, r2t, rows, seq_lens = make_case(torch.float32, 2, 6, 2, 16, lens, seed=3)
    before = ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.25)
    used = torch.zeros(k_pool.shape[0], dtype=torch.bool)
    for row, n in zip(rows.tolist(), lens):
        used[r2t[row, :n]] = True
    k_pool[~used], v_pool[~used] = 1e4, -1e4
    assert torch.equal(before, ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.25))


def test_bad_shapes_are_refused(ops):
    q, k_pool, v_pool, r2t, rows, seq_lens = make_case(torch.float32, 2, 6, 4, 16, [3, 4])
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.25)
    q, k_pool, v_pool, r2t, rows, seq_lens = make_case(torch.float32, 2, 4, 4, 16, [3, 4])
    with pytest.raises(RuntimeError, match="int64"):
        ops.decode_attention(q, k_pool, v_pool, r2t.int(), rows, seq_lens, 0.25)
    with pytest.raises(RuntimeError, match="one row and one length per query"):
        ops.decode_attention(q, k_pool, v_pool, r2t, rows[:1], seq_lens[:1], 0.25)


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.bfloat16, torch.float8_e5m2), (torch.float32, torch.float8_e4m3fn)])
def test_new_kv_is_stored_as_set_kv_stores_it_then_attended(ops, dtype, kv_dtype):
    """Given the step's K/V (views into a qkv row, like the model's) and their slots, the op writes
    the pool exactly as KVPool.set_kv does (fp8 rounding, e4m3's clamp) before it reads: the
    output equals set_kv followed by the op without them."""
    from tandem.runtime.cache.pools import KVPool

    lens = [5, 1, 40]
    hq, hkv, d = 9, 3, 64
    q, _, _, r2t, rows, seq_lens = make_case(dtype, len(lens), hq, hkv, d, lens, seed=7)
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * d, generator=g) * 300  # past e4m3's +-448 for some
    qkv = qkv.to(dtype)
    k, v = (qkv[:, (hq + i * hkv) * d:(hq + (i + 1) * hkv) * d].view(len(lens), hkv, d) for i in (0, 1))
    loc = r2t[rows, seq_lens - 1]  # each request's newest position
    pools = [KVPool(int(r2t.max()) + 1, 1, hkv, d, kv_dtype or dtype, "cpu") for _ in range(2)]
    for pool in pools:
        pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g).to(pool.dtype))
        pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g).to(pool.dtype))
    pools[1].k_buffer[0].copy_(pools[0].k_buffer[0])
    pools[1].v_buffer[0].copy_(pools[0].v_buffer[0])
    pools[0].set_kv(0, loc, k, v)
    want = ops.decode_attention(q, pools[0].k_buffer[0], pools[0].v_buffer[0], r2t, rows, seq_lens, 0.125)
    got = ops.decode_attention(q, pools[1].k_buffer[0], pools[1].v_buffer[0], r2t, rows, seq_lens, 0.125, k, v, loc)
    as_bytes = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731 - fp8 has no equality
    assert torch.equal(as_bytes(pools[1].k_buffer[0]), as_bytes(pools[0].k_buffer[0]))
    assert torch.equal(as_bytes(pools[1].v_buffer[0]), as_bytes(pools[0].v_buffer[0]))
    assert torch.equal(got, want)


def test_bad_new_kv_is_refused(ops):
    q, k_pool, v_pool, r2t, rows, seq_lens = make_case(torch.float32, 2, 4, 2, 16, [3, 4])
    k = v = torch.zeros(2, 2, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.25, k, v, torch.tensor([0, k_pool.shape[0]]))
    with pytest.raises(RuntimeError, match="come together"):
        ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.25, k, v, None)
    with pytest.raises(RuntimeError, match="q's dtype"):
        ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.25, k.double(), v, torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="kv_heads"):
        ops.decode_attention(q, k_pool, v_pool, r2t, rows, seq_lens, 0.25, k[:, :1], v, torch.tensor([1, 2]))


def test_every_csrc_file_is_built_or_hashed_and_shipped():
    """A header missing from _HEADERS would not rebuild the op when it changes; a file missing
    from the package data would be absent from a wheel, and the op would not build there."""
    csrc = REPO / "kernels" / "csrc"
    on_disk = {path.name for path in csrc.iterdir() if path.suffix in {".cpp", ".h"}}
    assert on_disk == set(cpu_ops._SOURCES) | set(cpu_ops._HEADERS)
    with open(REPO / "pyproject.toml", "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["tandem.kernels"]
    unshipped = [name for name in sorted(on_disk) if not any(fnmatch.fnmatch(f"csrc/{name}", g) for g in globs)]
    assert unshipped == []

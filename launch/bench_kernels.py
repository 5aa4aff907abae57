"""`python -m tandem.launch.bench_kernels`: time each Triton kernel against its torch reference
(and attention against torch SDPA) on serving-sized bf16 shapes, and report achieved memory
bandwidth as a fraction of the device's peak. The kernels: the small ops (norms, SiLU-and-mul,
rotary, KV store), decode and extend attention, the grammar token bitmask, the fused MoE and the
weight-only quantized linears (w4a16, w8a16; timed against the dense bf16 linear they replace).

`--check-only` instead runs every kernel against its reference on small shapes, on CPU under the
Triton interpreter when there is no GPU, and exits 0 when all agree, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch

# Peak HBM bandwidth in GB/s by device-name substring; more specific names first.
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("GH200", 4000.0), ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
    ("H800", 3350.0), ("H20", 4000.0), ("B200", 8000.0), ("A100-PCIE-40GB", 1555.0), ("A100-SXM4-40GB", 1555.0),
    ("A100", 2039.0), ("A800", 2039.0), ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0),
    ("A10", 600.0), ("RTX 4090", 1008.0), ("RTX 3090", 936.0),
)
HQ, HKV, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336  # Llama-3-8B-like layer
VOCAB = 128256  # Llama-3's: the grammar bitmask's row
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTERMEDIATE = 128, 8, 2048, 768  # Qwen3-30B-A3B-like MoE layer


@dataclass
class Check:
    """One --check-only comparison of a kernel with its reference."""
    kernel: str
    dtype: str
    max_abs_err: float
    ok: bool


@dataclass
class Row:
    kernel: str
    shape: str
    triton_us: float
    torch_us: float | None
    sdpa_us: float | None
    gbytes: float
    tflop: float = 0.0


# ---------------------------------------------------------------- correctness (--check-only)

def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> Check:
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = 1.0 + (want.float().abs().max().item() if want.numel() else 0.0)
    ok = err <= tol * scale  # relative to the output's magnitude
    print(f"  {'ok  ' if ok else 'FAIL'} {name:<34} max abs err {err:.2e}")
    return Check(name, str(got.dtype).removeprefix("torch."), err, ok)


def _check_small_ops(dtype: torch.dtype, dev: str, tol: float) -> list[Check]:
    from tandem.kernels import activation, kv_store, norm, rotary

    x, r, w = (torch.randn(5, 96, dtype=dtype, device=dev) for _ in range(3))
    out, res = norm.fused_add_rmsnorm(x, r, w[0], 1e-6)
    want_out, want_res = norm.fused_add_rmsnorm_ref(x, r, w[0], 1e-6)
    gu = torch.randn(3, 2 * 80, dtype=dtype, device=dev)
    q, k = torch.randn(4, 4, 64, dtype=dtype, device=dev), torch.randn(4, 2, 64, dtype=dtype, device=dev)
    pos = torch.tensor([0, 3, 9, 31], device=dev)
    cos_sin = torch.randn(32, 64, device=dev)
    q_ref, k_ref = rotary.rotary_ref(pos, q, k, cos_sin)
    rotary.apply_rotary_(pos, q, k, cos_sin)
    bufs = [torch.zeros(10, 2, 64, dtype=dtype, device=dev) for _ in range(4)]
    loc = torch.tensor([2, 9, 5, 1], device=dev)
    kv_store.store_kv(bufs[0], bufs[1], loc, k, q[:, :2])
    kv_store.store_kv_ref(bufs[2], bufs[3], loc, k, q[:, :2])
    return [_close("rmsnorm", norm.rmsnorm(x, w[0], 1e-6), norm.rmsnorm_ref(x, w[0], 1e-6), tol),
            _close("fused_add_rmsnorm", torch.cat([out, res]), torch.cat([want_out, want_res]), tol),
            _close("silu_and_mul", activation.silu_and_mul(gu), activation.silu_and_mul_ref(gu), tol),
            _close("rotary", torch.cat([q.flatten(), k.flatten()]), torch.cat([q_ref.flatten(), k_ref.flatten()]), tol),
            _close("store_kv", torch.cat(bufs[:2]), torch.cat(bufs[2:]), 0.0)]


def _check_attention(dtype: torch.dtype, dev: str, tol: float) -> list[Check]:
    from tandem.kernels.decode_attention import decode_attention_fwd, decode_attention_ref, num_kv_splits
    from tandem.kernels.extend_attention import extend_attention_fwd, extend_attention_ref

    prefix, ext, hq, hkv, d = [0, 3, 40], [1, 12, 5], 8, 2, 64
    k_buf, v_buf = (torch.randn(64, hkv, d, dtype=dtype, device=dev) for _ in range(2))
    kv_indices = torch.randperm(63, device=dev)[:sum(prefix)] + 1
    kv_indptr = torch.tensor([0, *prefix], device=dev).cumsum(0)
    qo_indptr = torch.tensor([0, *ext], device=dev).cumsum(0)
    q = torch.randn(sum(ext), hq, d, dtype=dtype, device=dev)
    k, v = (torch.randn(sum(ext), hkv, d, dtype=dtype, device=dev) for _ in range(2))
    args = (q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices)
    ext_out = extend_attention_fwd(*args, max(ext), d ** -0.5, block_m=16, block_n=16)
    ok = [_close("extend_attention", ext_out, extend_attention_ref(*args, d ** -0.5), tol)]
    lens = [1, 3, 40]  # decode: every request has at least its own new key
    dec_indptr = torch.tensor([0, *lens], device=dev).cumsum(0)
    dec_indices = torch.randperm(63, device=dev)[:sum(lens)] + 1
    splits = num_kv_splits(lens, hkv, min_split_len=16, max_splits=4)
    qd = q[:3]
    dec = decode_attention_fwd(qd, k_buf, v_buf, dec_indptr, dec_indices,
                               torch.tensor(splits, dtype=torch.int32, device=dev), max(splits), d ** -0.5, block_n=16)
    want = decode_attention_ref(qd, k_buf, v_buf, dec_indptr, dec_indices, d ** -0.5)
    ok.append(_close("decode_attention", dec, want, tol))
    return ok


def _neg_inf_split(x: torch.Tensor) -> torch.Tensor:
    """x's -inf positions (as 1) beside its other values (-inf as 0): comparable by _close, where
    -inf minus -inf would be nan."""
    masked = x.isneginf()
    return torch.cat([masked.to(x.dtype).flatten(), x.masked_fill(masked, 0).flatten()])


def _check_token_bitmask(dtype: torch.dtype, dev: str) -> list[Check]:
    from tandem.kernels.reference import apply_token_bitmask_ref
    from tandem.kernels.token_bitmask import apply_token_bitmask

    n, vocab = 5, 1000  # vocab not a multiple of 32 nor of the block: the tail word and block are partial
    logits = torch.randn(n, vocab, dtype=dtype, device=dev)
    bitmask = torch.randint(-(2 ** 31), 2 ** 31 - 1, (3, (vocab + 31) // 32), dtype=torch.int64,
                            device=dev).to(torch.int32)
    rows = torch.tensor([4, 0, 2], device=dev)  # rows 1 and 3 unconstrained: left alone
    got, want = logits.clone(), logits.clone()
    apply_token_bitmask(got, bitmask, rows, block=256)
    apply_token_bitmask_ref(want, bitmask, rows)
    return [_close("token_bitmask", _neg_inf_split(got), _neg_inf_split(want), 0.0)]


def _check_fused_moe(dtype: torch.dtype, dev: str, tol: float) -> list[Check]:
    from tandem.kernels.fused_moe import fused_moe
    from tandem.kernels.moe_reference import fused_moe_ref, route

    tokens, hidden, width, experts, top_k = 37, 64, 48, 8, 2
    x = torch.randn(tokens, hidden, dtype=dtype, device=dev)
    w13 = (torch.randn(experts, 2 * width, hidden, device=dev) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, width, device=dev) * width ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, device=dev)
    logits[:, experts // 2:] -= 8  # some experts chosen by few tokens or none
    weights, ids = route(logits, top_k, renormalize=True)
    # the reference in float64: the kernel keeps fp32 between its GEMMs, the loop rounds to dtype
    want = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    return [_close("fused_moe", fused_moe(x, w13, w2, weights, ids), want, tol)]


def _check_dequant_gemm(dtype: torch.dtype, dev: str, tol: float) -> list[Check]:
    from tandem.kernels import dequant_gemm
    from tandem.kernels.dequant_reference import dequant_linear_ref, quantize_int4, quantize_int8

    tokens, n, k = 7, 72, 128  # N a multiple of 8 but not of the block
    x = torch.randn(tokens, k, dtype=dtype, device=dev)
    w = torch.randn(n, k)
    q4, s4, z4 = (t.to(dev) for t in quantize_int4(w, 32))
    q8, s8 = (t.to(dev) for t in quantize_int8(w[:, :100]))  # K not a multiple of the block
    w4 = (q4, s4.to(dtype), z4, 32, 4)
    w8 = (q8, s8.to(dtype), None, -1, 8)
    # the reference in float64: the kernel's products are exact and its sums fp32
    return [_close("dequant_gemm_w4a16", dequant_gemm.dequant_linear(x, *w4), dequant_linear_ref(x.double(), *w4), tol),
            _close("dequant_gemm_w8a16", dequant_gemm.dequant_linear(x[:, :100], *w8),
                   dequant_linear_ref(x[:, :100].double(), *w8), tol)]


def run_checks() -> list[Check]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if dev == "cuda" else [])  # bf16: no interpreter
    tols = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
    results = []
    for dtype in dtypes:
        print(f"{dtype} on {dev}{' (Triton interpreter)' if dev == 'cpu' else ''}:")
        torch.manual_seed(0)
        results += _check_small_ops(dtype, dev, tols[dtype]) + _check_attention(dtype, dev, tols[dtype])
        results += _check_token_bitmask(dtype, dev) + _check_fused_moe(dtype, dev, tols[dtype])
        results += _check_dequant_gemm(dtype, dev, tols[dtype])
    print(f"{sum(c.ok for c in results)}/{len(results)} checks passed")
    return results


# ---------------------------------------------------------------- timing (GPU)

def _time_us(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1000.0


def _fits(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.8 * free


def _bench_decode(bs: int, ctx: int) -> Row | None:
    from tandem.kernels.decode_attention import decode_attention_fwd, num_kv_splits

    dt, dev = torch.bfloat16, "cuda"
    kv_bytes = 2 * bs * ctx * HKV * HEAD_DIM * 2
    if not _fits(2 * kv_bytes):  # pool + the dense copy SDPA reads
        return None
    k_buf, v_buf = (torch.randn(bs * ctx + 1, HKV, HEAD_DIM, dtype=dt, device=dev) for _ in range(2))
    q = torch.randn(bs, HQ, HEAD_DIM, dtype=dt, device=dev)
    kv_indptr = (torch.arange(bs + 1, device=dev) * ctx).to(torch.int32)
    kv_indices = torch.arange(1, bs * ctx + 1, device=dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = num_kv_splits([ctx] * bs, HKV, target_programs=2 * sms)
    num_splits = torch.tensor(splits, dtype=torch.int32, device=dev)
    scale = HEAD_DIM ** -0.5
    t_triton = _time_us(lambda: decode_attention_fwd(q, k_buf, v_buf, kv_indptr, kv_indices, num_splits,
                                                     max(splits), scale))
    # dense SDPA: each kv head's q group acts as a short query with no mask (flash path)
    kd, vd = (b[1:].view(bs, ctx, HKV, HEAD_DIM).transpose(1, 2).contiguous() for b in (k_buf, v_buf))
    qd = q.view(bs, HKV, HQ // HKV, HEAD_DIM)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t_sdpa = _time_us(lambda: sdpa(qd, kd, vd, scale=scale))
    kd = vd = None  # frees the dense copies (a `del` would leave the lambda a name pyflakes calls undefined)
    t_torch = None
    if _fits(kv_bytes):  # the torch backend path: gather pages, then SDPA
        slots = kv_indices.view(bs, ctx)
        qp = q[:, :, None]
        t_torch = _time_us(lambda: sdpa(qp, k_buf[slots].transpose(1, 2), v_buf[slots].transpose(1, 2), scale=scale,
                                        enable_gqa=True))
    return Row("decode_attention", f"bs={bs} ctx={ctx}", t_triton, t_torch, t_sdpa, kv_bytes / 1e9,
               4 * bs * ctx * HQ * HEAD_DIM / 1e12)


def _bench_extend(bs: int, ext: int, prefix: int) -> Row | None:
    from tandem.kernels.extend_attention import extend_attention_fwd, extend_attention_ref

    dt, dev, ctx, tokens = torch.bfloat16, "cuda", prefix + ext, bs * ext
    k_buf, v_buf = (torch.randn(bs * prefix + 1, HKV, HEAD_DIM, dtype=dt, device=dev) for _ in range(2))
    q = torch.randn(tokens, HQ, HEAD_DIM, dtype=dt, device=dev)
    k, v = (torch.randn(tokens, HKV, HEAD_DIM, dtype=dt, device=dev) for _ in range(2))
    qo_indptr = (torch.arange(bs + 1, device=dev) * ext).to(torch.int32)
    kv_indptr = (torch.arange(bs + 1, device=dev) * prefix).to(torch.int32)
    kv_indices = torch.arange(1, bs * prefix + 1, device=dev)
    args, scale = (q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices), HEAD_DIM ** -0.5
    t_triton = _time_us(lambda: extend_attention_fwd(*args, ext, scale))
    score_bytes = 4 * HQ * ext * ctx  # the reference materializes fp32 scores per request
    t_torch = _time_us(lambda: extend_attention_ref(*args, scale)) if _fits(3 * score_bytes) else None
    kd = torch.cat([k_buf[1:].view(bs, prefix, HKV, HEAD_DIM), k.view(bs, ext, HKV, HEAD_DIM)], 1).transpose(1, 2)
    vd = torch.cat([v_buf[1:].view(bs, prefix, HKV, HEAD_DIM), v.view(bs, ext, HKV, HEAD_DIM)], 1).transpose(1, 2)
    qd = q.view(bs, ext, HQ, HEAD_DIM).transpose(1, 2)
    mask = None if prefix == 0 else torch.ones(ext, ctx, dtype=torch.bool, device=dev).tril(prefix)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t_sdpa = _time_us(lambda: sdpa(qd, kd, vd, attn_mask=mask, is_causal=prefix == 0, scale=scale, enable_gqa=True))
    nbytes = 2 * tokens * (2 * HQ + 2 * HKV) * HEAD_DIM + 2 * 2 * bs * prefix * HKV * HEAD_DIM
    flop = 4 * bs * HQ * HEAD_DIM * (ext * prefix + ext * (ext + 1) / 2)
    return Row("extend_attention", f"bs={bs} ext={ext} prefix={prefix}", t_triton, t_torch, t_sdpa, nbytes / 1e9,
               flop / 1e12)


def _bench_small_ops(tokens: int) -> list[Row]:
    from tandem.kernels import activation, kv_store, norm, rotary

    dt, dev, rows = torch.bfloat16, "cuda", []
    x, r = (torch.randn(tokens, HIDDEN, dtype=dt, device=dev) for _ in range(2))
    w = torch.ones(HIDDEN, dtype=dt, device=dev)
    act = 2 * tokens * HIDDEN * 2
    rows.append(Row("rmsnorm", f"T={tokens} H={HIDDEN}", _time_us(lambda: norm.rmsnorm(x, w, 1e-6)),
                    _time_us(lambda: norm.rmsnorm_ref(x, w, 1e-6)), None, act / 1e9))
    rows.append(Row("fused_add_rmsnorm", f"T={tokens} H={HIDDEN}",
                    _time_us(lambda: norm.fused_add_rmsnorm(x, r, w, 1e-6)),
                    _time_us(lambda: norm.fused_add_rmsnorm_ref(x, r, w, 1e-6)), None, 2 * act / 1e9))
    gu = torch.randn(tokens, 2 * INTERMEDIATE, dtype=dt, device=dev)
    rows.append(Row("silu_and_mul", f"T={tokens} I={INTERMEDIATE}", _time_us(lambda: activation.silu_and_mul(gu)),
                    _time_us(lambda: activation.silu_and_mul_ref(gu)), None, 3 * tokens * INTERMEDIATE * 2 / 1e9))
    q = torch.randn(tokens, HQ, HEAD_DIM, dtype=dt, device=dev)
    k = torch.randn(tokens, HKV, HEAD_DIM, dtype=dt, device=dev)
    pos = torch.randint(0, 32768, (tokens,), device=dev)
    cos_sin = torch.randn(32768, HEAD_DIM, device=dev)
    qk_bytes = 2 * tokens * (HQ + HKV) * HEAD_DIM * 2 + tokens * HEAD_DIM * 4
    rows.append(Row("rotary", f"T={tokens} Hq={HQ} Hkv={HKV}",
                    _time_us(lambda: rotary.apply_rotary_(pos, q, k, cos_sin)),
                    _time_us(lambda: rotary.rotary_ref(pos, q, k, cos_sin)), None, qk_bytes / 1e9))
    k_buf, v_buf = (torch.zeros(65536 + 1, HKV, HEAD_DIM, dtype=dt, device=dev) for _ in range(2))
    loc = torch.randperm(65536, device=dev)[:tokens] + 1
    rows.append(Row("store_kv", f"T={tokens} Hkv={HKV}", _time_us(lambda: kv_store.store_kv(k_buf, v_buf, loc, k, k)),
                    _time_us(lambda: kv_store.store_kv_ref(k_buf, v_buf, loc, k, k)), None,
                    2 * 2 * tokens * HKV * HEAD_DIM * 2 / 1e9))
    return rows


def _bench_token_bitmask(bs: int) -> Row:
    """One grammar-constrained decode step: bs rows of VOCAB logits, each token allowed with
    probability 1/32 (a grammar allows few tokens). Bytes: the bitmask read and the -inf written."""
    from tandem.kernels.reference import apply_token_bitmask_ref
    from tandem.kernels.token_bitmask import apply_token_bitmask

    dt, dev, words = torch.bfloat16, "cuda", (VOCAB + 31) // 32
    logits = torch.randn(bs, VOCAB, dtype=dt, device=dev)
    bits = [torch.randint(-(2 ** 31), 2 ** 31 - 1, (bs, words), dtype=torch.int64, device=dev).to(torch.int32)
            for _ in range(5)]
    bitmask = bits[0] & bits[1] & bits[2] & bits[3] & bits[4]
    rows = torch.arange(bs, device=dev)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    allowed = int(((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :VOCAB].sum())
    nbytes = bitmask.numel() * 4 + (bs * VOCAB - allowed) * logits.element_size()
    return Row("token_bitmask", f"B={bs} V={VOCAB}", _time_us(lambda: apply_token_bitmask(logits, bitmask, rows)),
               _time_us(lambda: apply_token_bitmask_ref(logits, bitmask, rows)), None, nbytes / 1e9)


def _bench_fused_moe(tokens: int) -> Row:
    """One MoE layer, random routing. Bytes: the weights of the experts chosen, x read and the
    output written (the intermediates the two GEMMs pass through memory are not counted)."""
    from tandem.kernels.fused_moe import fused_moe
    from tandem.kernels.moe_reference import fused_moe_ref, route

    dt, dev = torch.bfloat16, "cuda"
    e, k, h, i = MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTERMEDIATE
    x = torch.randn(tokens, h, dtype=dt, device=dev)
    w13 = torch.randn(e, 2 * i, h, dtype=dt, device=dev) * h ** -0.5
    w2 = torch.randn(e, h, i, dtype=dt, device=dev) * i ** -0.5
    weights, ids = route(torch.randn(tokens, e, device=dev), k, renormalize=True)
    chosen = ids.unique().numel()
    nbytes = chosen * 3 * i * h * 2 + 2 * tokens * h * 2
    return Row("fused_moe", f"T={tokens} E={e} K={k} I={i}", _time_us(lambda: fused_moe(x, w13, w2, weights, ids)),
               _time_us(lambda: fused_moe_ref(x, w13, w2, weights, ids)), None, nbytes / 1e9,
               6 * tokens * k * i * h / 1e12)


def _bench_dequant_gemm(tokens: int) -> list[Row]:
    """x [tokens, HIDDEN] @ W.T for an up-projection-sized W [INTERMEDIATE, HIDDEN] held as int4
    (group 128, with zeros) and as per-channel int8, against the dense bf16 linear on the
    dequantized weight (what --quantization none serves). Bytes: the stored weight, x and the output."""
    from tandem.kernels.dequant_reference import quantize_int4, quantize_int8

    dt, dev, n, k = torch.bfloat16, "cuda", INTERMEDIATE, HIDDEN
    x = torch.randn(tokens, k, dtype=dt, device=dev)
    w = torch.randn(n, k, device=dev) * k ** -0.5
    q4, s4, z4 = quantize_int4(w, 128)
    q8, s8 = quantize_int8(w)
    return [_bench_dequant_linear("dequant_w4a16", x, (q4, s4.to(dt), z4, 128, 4)),
            _bench_dequant_linear("dequant_w8a16", x, (q8, s8.to(dt), None, -1, 8))]


def _bench_dequant_linear(name: str, x: torch.Tensor, args: tuple) -> Row:
    from tandem.kernels.dequant_gemm import dequant_linear
    from tandem.kernels.dequant_reference import dequantize

    (tokens, k), n = x.shape, args[1].shape[-1]
    dense = dequantize(*args, x.dtype)
    stored = sum(t.numel() * t.element_size() for t in args[:3] if t is not None)
    return Row(name, f"T={tokens} N={n} K={k}", _time_us(lambda: dequant_linear(x, *args)),
               _time_us(lambda: torch.nn.functional.linear(x, dense)), None,
               (stored + x.element_size() * tokens * (n + k)) / 1e9, 2 * tokens * n * k / 1e12)


def peak_gbps(name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS if key.lower() in name.lower()), None)


def _print_table(rows: list[Row], peak: float | None) -> None:
    def us(t: float | None) -> str:
        return f"{t:10.1f}" if t is not None else f"{'-':>10}"

    print(f"{'kernel':<18} {'shape':<28} {'triton us':>10} {'torch us':>10} {'sdpa us':>10} {'x torch':>8} "
          f"{'GB/s':>8} {'%peak':>6} {'TFLOP/s':>8}")
    for row in rows:
        gbs = row.gbytes / (row.triton_us * 1e-6)
        ratio = f"{row.torch_us / row.triton_us:8.2f}" if row.torch_us else f"{'-':>8}"
        frac = f"{100 * gbs / peak:6.1f}" if peak else f"{'-':>6}"
        tflops = f"{row.tflop / (row.triton_us * 1e-6):8.1f}" if row.tflop else f"{'-':>8}"
        print(f"{row.kernel:<18} {row.shape:<28} {us(row.triton_us)} {us(row.torch_us)} {us(row.sdpa_us)} {ratio} "
              f"{gbs:8.0f} {frac} {tflops}")


def run_bench(args: argparse.Namespace) -> list[Row]:
    name = torch.cuda.get_device_name(0)
    peak = args.peak_gbps or peak_gbps(name)
    print(f"device: {name}; peak bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}")
    rows: list[Row] = []
    for tokens in args.tokens:
        rows += _bench_small_ops(tokens)
        rows.append(_bench_fused_moe(tokens))
        rows += _bench_dequant_gemm(tokens)
        torch.cuda.empty_cache()
    for bs in args.batch:
        rows.append(_bench_token_bitmask(bs))
    for bs in args.batch:
        for ctx in args.ctx:
            row = _bench_decode(bs, ctx)
            if row is None:
                print(f"skip decode bs={bs} ctx={ctx}: not enough free GPU memory")
            rows += [row] if row else []
            torch.cuda.empty_cache()
    for bs, ext, prefix in ((1, 4096, 0), (8, 512, 0), (4, 1024, 7168), (1, 1024, 31744)):
        row = _bench_extend(bs, ext, prefix)
        rows += [row] if row else []
        torch.cuda.empty_cache()
    _print_table(rows, peak)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-only", action="store_true", help="correctness on small shapes (CPU ok), no timing")
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth in GB/s")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256],
                        help="batch sizes for decode attention and the token bitmask")
    parser.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192],
                        help="token counts for the small ops, the fused MoE and the quantized linears")
    parser.add_argument("--output-file", "--json", dest="output_file", default=None,
                        help="also write the rows (or, with --check-only, the checks) to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        # must precede the first import of a kernel module: triton.jit reads it then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.check_only:
        checks = run_checks()
        _write_json(args.output_file, "checks", checks)
        return 0 if all(c.ok for c in checks) else 1
    if not torch.cuda.is_available():
        print("timing needs a CUDA GPU; use --check-only on CPU", file=sys.stderr)
        return 2
    _write_json(args.output_file, "rows", run_bench(args))
    return 0


def _write_json(path: str | None, key: str, items: list[Check] | list[Row]) -> None:
    if path is None:
        return
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (Triton interpreter)"
    with open(path, "w") as f:
        json.dump({"device": device, key: [asdict(item) for item in items]}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

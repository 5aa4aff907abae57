"""Packed linears (runtime/model/packed_linear.py): bf16 weights in oneDNN's blocked layout on CPUs
with native bf16, where a packed linear equals torch's plain bf16 linear bit for bit (the same
oneDNN kernels, the weight blocked once instead of per call); fp32 weights in MKL's packed-GEMM
layout or oneDNN's blocked one (whichever measures faster; both are tested on every CPU), equal to
the plain linear up to float32 summation order. A whole model, tied LM head (a packed copy of the
embedding) and qkv bias included, gives the plain model's tokens.
"""
from __future__ import annotations

import time

import pytest
import torch

from tandem.runtime.envs import envs
from tandem.launch import gemm_bound
from tandem.runtime.model import packed_linear
from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.packed_linear import PackedLinear, packs_weights
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(300)

# Packing bf16 is a fast path for CPUs with AMX-BF16 / AVX512-BF16; elsewhere tandem never packs
# bf16 (asserted below on every CPU) and oneDNN's bf16 linear may not even exist, so there is
# nothing to compare. fp32 packs wherever torch was built with MKL and MKL-DNN (every x86 wheel),
# in either layout, and both layouts are tested there.
needs_native_bf16 = pytest.mark.skipif(not packs_weights(torch.bfloat16),
                                       reason="this CPU has no native bf16: tandem keeps torch's plain linear")
needs_fp32_packing = pytest.mark.skipif(not packs_weights(torch.float32),
                                        reason="torch without MKL or MKL-DNN: tandem keeps torch's plain fp32 linear")


def test_which_weights_are_packed(monkeypatch):
    has_mkl = torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    assert packs_weights(torch.bfloat16) == torch.backends.mkldnn.is_available()
    assert packs_weights(torch.float32) == has_mkl
    assert not packs_weights(torch.float16)
    assert not packs_weights(torch.bfloat16, "meta") and not packs_weights(torch.float32, "meta")
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: {"avx512f", "avx2"})
    assert not packs_weights(torch.bfloat16)
    assert packs_weights(torch.float32) == has_mkl  # fp32 GEMMs need no bf16 instructions
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert not packs_weights(torch.float32)  # oneDNN's fp32 only where it was measured against MKL
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: {"amx_bf16"})
    monkeypatch.setenv(envs.CPU_PACK_WEIGHTS.name, "0")
    assert not packs_weights(torch.bfloat16) and not packs_weights(torch.float32)


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_torch_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 80, generator=g).bfloat16()
    layer = PackedLinear(w, b)
    assert layer.weight.is_mkldnn and tuple(layer.weight.shape) == (96, 80)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w, b))


@needs_fp32_packing
@pytest.mark.parametrize("layout", ["mkl", "onednn"])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300, 2100])  # around the 512 rows MKL's plan is made for
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_packed_linear_equals_torch_linear(layout, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 80, generator=g), torch.randn(rows, 80, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    weight = packed_linear.pack(w, layout)
    if layout == "mkl":
        assert isinstance(weight, packed_linear.MklPackedWeight)
        assert weight.like.untyped_storage().nbytes() == 4  # the plain weight is not kept
    else:
        assert weight.is_mkldnn
    assert tuple(weight.shape) == (96, 80)
    got, want = packed_linear.linear(x, weight, b), torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape == (rows, 96)
    # other blocking of the same float32 sums: a few ulps of terms of size ~sqrt(80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # batched input (a leading dim) and a non-contiguous one (a slice of a wider activation)
    wide = torch.randn(2, rows, 100, generator=g)
    torch.testing.assert_close(packed_linear.linear(wide[..., :80], weight, b),
                               torch.nn.functional.linear(wide[..., :80], w, b), rtol=1e-5, atol=1e-5)


@needs_fp32_packing
@pytest.mark.parametrize("vendor, want", [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("", "onednn")])
def test_fp32_layout_follows_the_vendor_never_a_timing(monkeypatch, vendor, want):
    """A rule: the layout decides the last bits of every answer, so it must not change from start
    to start with how a matmul timed."""
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(time, "perf_counter", lambda: pytest.fail("the fp32 layout was timed"))
    name, why = packed_linear.fp32_layout()
    assert name == want and why
    packed = packed_linear.pack(torch.randn(8, 4))
    assert isinstance(packed, packed_linear.MklPackedWeight) if want == "mkl" else packed.is_mkldnn
    with pytest.raises(ValueError, match="fp32_as"):
        packed_linear.pack(torch.randn(8, 4), "openblas")


@needs_fp32_packing
def test_onednn_runs_the_padded_row_count(monkeypatch):
    """What oneDNN receives: the padded rows, and only the real rows come back."""
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise
    def spy(x, *rest):
        seen.append(x.numel() // x.shape[-1])
        return real(x, *rest)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 16, generator=g), torch.randn(3, 50, 16, generator=g)  # 150 rows -> 152
    out = packed_linear.linear(x, packed_linear.pack(w, "onednn"))
    assert seen == [152] and out.shape == (3, 50, 24)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    packed_linear.linear(x[:, :20], packed_linear.pack(w, "onednn"))  # 60 rows: decode-sized, exact
    assert seen == [152, 60]


def test_onednn_row_counts_are_bounded():
    """oneDNN keeps a compiled kernel per row count: decode batches keep theirs, longer inputs
    share one of 16 padded sizes per octave, never more than 1/16 larger."""
    rows = range(1, 8193)
    padded = [packed_linear.padded_rows(r) for r in rows]
    assert padded[0] == packed_linear.MIN_ROWS == 2  # oneDNN's one-row kernel sums in another order
    assert padded[1:packed_linear.EXACT_ROWS] == list(range(2, packed_linear.EXACT_ROWS + 1))
    assert all(r <= p <= r * (1 + 1 / packed_linear.PADS_PER_OCTAVE) for r, p in zip(rows[1:], padded[1:]))
    assert padded == sorted(padded)  # more rows never run at fewer
    octaves = 7  # 64 < rows <= 8192
    assert len(set(padded)) <= packed_linear.EXACT_ROWS + octaves * packed_linear.PADS_PER_OCTAVE + 1
    assert packed_linear.padded_rows(0) == 0


def _packed_as_the_model_holds_it(weight, dtype: torch.dtype) -> bool:
    # an MKL-packed weight is no tensor (no dtype, no is_mkldnn): ask for it by type first
    if dtype == torch.bfloat16 and packed_linear.amx_ops() is not None:
        return isinstance(weight, packed_linear.AmxPackedWeight)
    if dtype == torch.bfloat16 or packed_linear.fp32_layout()[0] == "onednn":
        return isinstance(weight, torch.Tensor) and weight.is_mkldnn
    return isinstance(weight, packed_linear.MklPackedWeight)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_native_bf16),
                                   pytest.param(torch.float32, marks=needs_fp32_packing)])
def test_gemm_bound_times_the_weights_as_the_model_holds_them(dtype):
    layers, head = gemm_bound._weights(ModelConfig(
        arch="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position=64, tie_word_embeddings=True,
        qkv_bias=False, qk_norm=False), dtype, 1)
    assert all(_packed_as_the_model_holds_it(w, dtype) for w in layers[0])
    assert _head_as_the_model_holds_it(head, dtype)


def _head_as_the_model_holds_it(head, dtype: torch.dtype) -> bool:
    """bf16 on the AMX kernel (fp32 sums kept), else fp32 packed in this CPU's fp32 layout (fp32_head)."""
    if dtype == torch.bfloat16 and packed_linear.amx_ops() is not None:
        return isinstance(head, packed_linear.AmxPackedWeight)
    if packs_weights(torch.float32):
        if packed_linear.fp32_layout()[0] == "mkl":
            return isinstance(head, packed_linear.MklPackedWeight)
        return head.is_mkldnn and head.dtype == torch.float32
    return isinstance(head, torch.Tensor) and head.dtype == torch.float32


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_native_bf16),
                                   pytest.param("float32/mkl", marks=needs_fp32_packing),
                                   pytest.param("float32/onednn", marks=needs_fp32_packing)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied LM head; untied with qkv bias
def test_packed_model_equals_the_plain_one(tiny_model_dir, monkeypatch, arch, dtype):
    dtype, _, layout = dtype.partition("/")
    if layout:
        monkeypatch.setattr(packed_linear, "fp32_layout", lambda: (layout, "the test's choice"))
    # 40 + 7 + 90 prefill rows: past EXACT_ROWS, so every packed oneDNN linear runs padded
    path, prompts = tiny_model_dir(arch), [list(range(300, 340)), list(range(500, 507)), list(range(600, 690))]
    results = []
    for pack in (False, True):
        monkeypatch.setenv(envs.CPU_PACK_WEIGHTS.name, str(int(pack)))
        runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=400, max_running_requests=3, dtype=dtype))
        linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
        assert len(linears) == (4 * runner.config.num_layers if pack else 0)  # 4 per layer
        if pack:
            assert _head_as_the_model_holds_it(runner.model._head_fp32, runner.model.embed_tokens.weight.dtype)
        results.append(BareLoop(runner).generate(prompts, 6, keep_logits=True))
    plain, packed = results
    assert plain.output_ids == packed.output_ids
    for a, b in zip(plain.step_logits, packed.step_logits):
        if dtype == "bfloat16":  # at hidden 64 the plain linear (oneDNN) and the AMX kernel sum alike
            assert torch.equal(a, b)
        else:  # MKL's or oneDNN's GEMM sums in other blocks: float32 rounding, through every layer
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

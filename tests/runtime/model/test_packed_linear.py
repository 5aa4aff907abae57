"""oneDNN-packed linears (runtime/model/packed_linear.py): tandem packs bf16 weights only on CPUs
with native bf16, and there a packed linear equals torch's plain bf16 linear bit for bit (the
same oneDNN kernels, the weight blocked once instead of per call), and so does a whole model,
tied LM head (a packed copy of the embedding) and qkv bias included."""
from __future__ import annotations

import pytest
import torch

from tandem.runtime.envs import envs
from tandem.runtime.model import gemm_bound, packed_linear
from tandem.runtime.model.bare_loop import BareLoop
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.packed_linear import PackedLinear, packs_weights
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(300)

# Packing is a bf16 fast path for CPUs with AMX-BF16 / AVX512-BF16; elsewhere tandem never packs
# (asserted below on every CPU) and oneDNN's bf16 linear may not even exist, so there is nothing
# to compare.
needs_native_bf16 = pytest.mark.skipif(not packs_weights(torch.bfloat16),
                                       reason="this CPU has no native bf16: tandem keeps torch's plain linear")


def test_only_bf16_on_a_cpu_with_native_bf16_is_packed(monkeypatch):
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    assert packs_weights(torch.bfloat16) == torch.backends.mkldnn.is_available()
    assert not packs_weights(torch.float32)  # MKL's fp32 path measured faster at batch 1 and in prefill
    assert not packs_weights(torch.bfloat16, "meta")
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: {"avx512f", "avx2"})
    assert not packs_weights(torch.bfloat16)
    monkeypatch.setattr(packed_linear, "cpu_flags", lambda: {"amx_bf16"})
    monkeypatch.setenv(envs.CPU_PACK_WEIGHTS.name, "0")
    assert not packs_weights(torch.bfloat16)


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


@needs_native_bf16
def test_gemm_bound_times_the_weights_as_the_model_holds_them():
    layers, head = gemm_bound._weights(ModelConfig(
        arch="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position=64, tie_word_embeddings=True,
        qkv_bias=False, qk_norm=False), torch.bfloat16, 1)
    assert all(w.is_mkldnn for w in layers[0]) and head.is_mkldnn


@needs_native_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied LM head; untied with qkv bias
def test_packed_model_equals_the_plain_one(tiny_model_dir, monkeypatch, arch):
    path, prompts = tiny_model_dir(arch), [list(range(300, 340)), list(range(500, 507))]
    results = []
    for pack in (False, True):
        monkeypatch.setenv(envs.CPU_PACK_WEIGHTS.name, str(int(pack)))
        runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=400, max_running_requests=2, dtype="bfloat16"))
        linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
        assert len(linears) == (4 * runner.config.num_layers + 1 if pack else 0)  # 4 per layer and the LM head
        results.append(BareLoop(runner).generate(prompts, 6, keep_logits=True))
    plain, packed = results
    assert plain.output_ids == packed.output_ids
    for a, b in zip(plain.step_logits, packed.step_logits):
        assert torch.equal(a, b)

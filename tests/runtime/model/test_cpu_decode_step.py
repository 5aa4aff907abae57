"""The C++ decode step (runtime/model/cpu_decode_step.py) equals the Python modules bit for bit, on
every layer variant the model has (qkv bias, q/k norm, o and MLP biases), on every weight layout
(oneDNN or MKL packed, plain), past oneDNN's exact row counts, and over an fp8 KV pool; and it runs
only where it applies."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.kernels.cpu_ops import load_cpu_ops
from tandem.runtime.cache.pools import KVPool, ReqToTokenPool, TokenAllocator
from tandem.runtime.model.attention import CpuAttnBackend, TorchAttnBackend
from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.cpu_decode_step import CpuDecodeStep
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode
from tandem.runtime.model.llama import CausalLM
from tandem.runtime.model.ops import TorchOps, create_ops
from tandem.runtime.model.packed_linear import EXACT_ROWS, AmxPackedWeight, MklPackedWeight, amx_ops, packs_weights
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.model.tensor_parallel import TensorParallel
from tandem.runtime.server_args import ServerArgs

OPS = load_cpu_ops()  # built here: a build that fails fails these tests, it never skips them

BASE = ModelConfig(arch="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position=512, tie_word_embeddings=True, qkv_bias=False, qk_norm=False)
VARIANTS = {
    "llama": {},
    "qwen2": {"qkv_bias": True, "tie_word_embeddings": False},
    "qwen3": {"qk_norm": True},
    "llama_all_biases": {"qkv_bias": True, "o_bias": True, "mlp_bias": True},
    "sliding_windows": {"layer_windows": (8, 0, 5)},  # per-layer windows shorter than most sequences
}


class Setup:
    """A random model of `cfg` with its pools and the cpu backend, and `bs` requests prefilled."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, pack: bool, bs: int, kv_dtype: torch.dtype | None = None):
        torch.manual_seed(0)
        self.model = CausalLM(cfg).eval()
        cos_sin = self.model.rotary.cos_sin  # float32 always, as the loader keeps it
        self.model.to(dtype).rotary.cos_sin = cos_sin
        with torch.no_grad():
            for p in self.model.parameters():
                p.normal_(0.0, 0.1)  # biases and norm weights too: a missed one changes the answer
        if pack:
            self.model.pack_weights()
        self.model.use_ops(create_ops("cpu"))
        self.pool = ReqToTokenPool(bs + 1, 64)
        self.allocator = TokenAllocator(bs * 40)
        self.kv = KVPool(bs * 40, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype or dtype)
        self.attn = CpuAttnBackend(self.kv, self.pool)
        self.rows = [self.pool.alloc() for _ in range(bs)]
        self.lens = [3 + (i * 7) % 20 for i in range(bs)]
        prompts = [[(i * 31 + t * 7) % cfg.vocab_size for t in range(n)] for i, n in enumerate(self.lens)]
        slots = self.allocator.alloc(sum(self.lens))
        offset = 0
        for row, n in zip(self.rows, self.lens):
            self.pool.req_to_token[row, :n] = slots[offset:offset + n]
            offset += n
        with torch.inference_mode():
            self.model.hidden_states(ForwardBatch.build(ForwardMode.EXTEND, [t for p in prompts for t in p], self.rows,
                                                        [0] * bs, self.lens, slots), self.attn)
        self.decode_slots = self.allocator.alloc(bs)
        self.pool.req_to_token[self.rows, self.lens] = self.decode_slots

    def decode_batch(self) -> ForwardBatch:
        ids = [(7 * i + 3) % self.model.cfg.vocab_size for i in range(len(self.rows))]
        return ForwardBatch.build(ForwardMode.DECODE, ids, self.rows, self.lens, [1] * len(self.rows),
                                  self.decode_slots)

    @torch.inference_mode()
    def modules(self, monkeypatch) -> torch.Tensor:
        with monkeypatch.context() as m:
            m.setenv("TANDEM_CPU_DECODE_STEP", "0")
            assert CpuDecodeStep.build(self.model, self.attn) is None
            layers = self.model.layers
            batch = self.decode_batch()
            self.attn.init_forward(batch)
            x, residual = self.model.embed_tokens(batch.input_ids), None
            for layer in layers:
                x, residual = layer(x, residual, batch, self.model.rotary, self.attn)
            return self.model.norm(x, residual)[0]

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        step = CpuDecodeStep.build(self.model, self.attn)
        assert step is not None
        batch = self.decode_batch()
        return step.hidden_states(self.model.embed_tokens(batch.input_ids), batch)


def _layouts() -> list[tuple[torch.dtype, bool]]:
    out = [(torch.float32, False), (torch.float32, True)]
    if packs_weights(torch.bfloat16):
        out.append((torch.bfloat16, True))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype,pack", _layouts(), ids=lambda v: str(v).removeprefix("torch."))
def test_the_step_equals_the_modules_bit_for_bit(variant, dtype, pack, monkeypatch):
    s = Setup(dataclasses.replace(BASE, **VARIANTS[variant]), dtype, pack, bs=5)
    assert torch.equal(s.modules(monkeypatch), s.step())


@pytest.mark.timeout(300)
def test_fp32_on_mkl_and_onednn_layouts(monkeypatch):
    """Both fp32 packings: the step reads MKL's (packed, like) pair and oneDNN's blocked tensor."""
    for layout in ("mkl", "onednn"):
        monkeypatch.setattr("tandem.runtime.model.packed_linear.fp32_layout", lambda: (layout, "test"))
        s = Setup(BASE, torch.float32, True, bs=3)
        is_mkl = isinstance(s.model.layers[0].self_attn.qkv_proj.weight, MklPackedWeight)
        assert is_mkl == (layout == "mkl")
        assert torch.equal(s.modules(monkeypatch), s.step())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_over_an_fp8_pool(kv_dtype, monkeypatch):
    s = Setup(BASE, torch.float32, True, bs=4, kv_dtype=kv_dtype)
    assert torch.equal(s.modules(monkeypatch), s.step())


@pytest.mark.timeout(300)
def test_a_batch_past_onednns_exact_row_counts(monkeypatch):
    """More rows than EXACT_ROWS: the packed linears compute padded row counts, as the modules do."""
    dtype = torch.bfloat16 if packs_weights(torch.bfloat16) else torch.float32
    monkeypatch.setattr("tandem.runtime.model.packed_linear.fp32_layout", lambda: ("onednn", "test"))
    monkeypatch.setenv("TANDEM_CPU_AMX_LINEAR", "0")  # bf16 on oneDNN, not the AMX kernel
    s = Setup(BASE, dtype, True, bs=EXACT_ROWS + 5)
    assert s.model.layers[0].self_attn.qkv_proj.weight.is_mkldnn
    assert torch.equal(s.modules(monkeypatch), s.step())


@pytest.mark.timeout(300)
def test_bf16_on_the_amx_kernel(monkeypatch):
    if amx_ops() is None:
        pytest.skip("no AMX-BF16 on this CPU: bf16 linears stay oneDNN's")
    s = Setup(BASE, torch.bfloat16, True, bs=EXACT_ROWS + 5)
    assert isinstance(s.model.layers[0].self_attn.qkv_proj.weight, AmxPackedWeight)
    assert torch.equal(s.modules(monkeypatch), s.step())


def test_it_applies_only_to_the_cpu_backend_on_one_rank(monkeypatch):
    s = Setup(BASE, torch.float32, False, bs=2)
    assert CpuDecodeStep.build(s.model, s.attn) is not None
    assert CpuDecodeStep.build(s.model, TorchAttnBackend(s.kv, s.pool)) is None
    monkeypatch.setattr(s.attn, "ops", None)  # the C++ ops not built
    assert CpuDecodeStep.build(s.model, s.attn) is None
    monkeypatch.undo()
    s.model.use_ops(TorchOps())  # the modules would round as torch does, the step as the C++ ops
    assert CpuDecodeStep.build(s.model, s.attn) is None
    s.model.use_ops(create_ops("cpu"))
    monkeypatch.setattr(s.model, "tp", TensorParallel(rank=0, size=2))  # the layers' all-reduces are Python's
    assert CpuDecodeStep.build(s.model, s.attn) is None


@pytest.mark.timeout(300)
def test_a_runner_decodes_through_the_step_and_answers_alike(tiny_model_dir, monkeypatch):
    """The whole model on a runner: the step runs every decode pass (never a prefill), and greedy
    ids and logits equal the modules'."""
    calls = []
    real = CpuDecodeStep.hidden_states
    monkeypatch.setattr(CpuDecodeStep, "hidden_states", lambda self, x, batch: calls.append(batch.mode) or real(self, x, batch))

    def generate(on: bool):
        monkeypatch.setenv("TANDEM_CPU_DECODE_STEP", "1" if on else "0")
        runner = ModelRunner(ServerArgs(model_path=tiny_model_dir("qwen2"), max_total_tokens=600, max_running_requests=4,
                                        attention_backend="cpu"))
        return BareLoop(runner).generate([list(range(300, 340)), [42, 43]], 10, keep_logits=True)

    off = generate(False)
    assert calls == []
    on = generate(True)
    assert calls == [ForwardMode.DECODE] * 9
    assert on.output_ids == off.output_ids
    assert all(torch.equal(a, b) for a, b in zip(on.step_logits, off.step_logits))


def test_packing_after_a_decode_rebuilds_the_step(monkeypatch):
    """A step holds the weights it was built on: packing replaces them, so the next decode builds anew."""
    s = Setup(BASE, torch.float32, False, bs=3)
    with torch.inference_mode():
        s.model.hidden_states(s.decode_batch(), s.attn)
    s.model.pack_weights()
    with torch.inference_mode():
        through_model = s.model.hidden_states(s.decode_batch(), s.attn)
    assert torch.equal(s.modules(monkeypatch), through_model)

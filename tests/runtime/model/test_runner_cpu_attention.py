"""The whole model with --attention-backend cpu (decode through the C++ paged op, norms, rotary and
SiLU through the C++ elementwise ops) equals the torch backend (the reference: gather into a
padded batch + SDPA, torch's ops); without the build it is the torch path."""
from __future__ import annotations

import pytest

from tandem.kernels import cpu_ops
from tandem.runtime.model import attention
from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.layers import RMSNorm
from tandem.runtime.model.ops import CpuOps, TorchOps
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

PROMPTS = [list(range(300, 340)), list(range(500, 507)), [42]]


def run(path: str, backend: str, dtype: str = "float32"):
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=600, max_running_requests=4,
                                    attention_backend=backend, dtype=dtype))
    return runner, BareLoop(runner).generate(PROMPTS, 12, keep_logits=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cpu_backend_equals_torch(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    _, ref = run(path, "torch")
    runner, res = run(path, "cpu")
    assert isinstance(runner.attn_backend, attention.CpuAttnBackend) and runner.attn_backend.ops is not None
    assert all(isinstance(m.ops, CpuOps) for m in runner.model.modules() if isinstance(m, RMSNorm))
    assert ref.output_ids == res.output_ids
    for a, b in zip(ref.step_logits, res.step_logits):
        assert (a - b).abs().max().item() < 1e-4  # fp32; only summation order differs


@pytest.mark.timeout(300)
def test_cpu_backend_in_bf16_follows_torch(tiny_model_dir):
    path = tiny_model_dir("llama")
    _, ref = run(path, "torch", "bfloat16")
    _, res = run(path, "cpu", "bfloat16")
    # both read the same bf16 pool; the op accumulates in fp32 where SDPA's bf16 path rounds
    # partial results, so logits agree to bf16's resolution of the logit scale, not bit for bit
    for a, b in zip(ref.step_logits[:1], res.step_logits[:1]):
        assert (a - b).abs().max().item() < 0.1
    assert ref.output_ids[0][:4] == res.output_ids[0][:4]


@pytest.mark.timeout(300)
def test_without_the_op_decode_is_the_torch_path(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: None)
    path = tiny_model_dir("llama")
    _, ref = run(path, "torch")
    runner, res = run(path, "cpu")
    assert runner.attn_backend.ops is None
    assert all(isinstance(m.ops, TorchOps) for m in runner.model.modules() if isinstance(m, RMSNorm))
    assert ref.output_ids == res.output_ids

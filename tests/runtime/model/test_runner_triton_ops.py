"""The whole model with --attention-backend triton (attention kernels and the fused small ops,
under the Triton interpreter on CPU) equals the torch backend."""
from __future__ import annotations

import pytest

from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_with_fused_ops_equals_torch(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    results = []
    for backend in ("torch", "triton"):
        runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=512, max_running_requests=4,
                                        attention_backend=backend, dtype="float32"))  # the interpreter: no bf16
        assert runner.model.norm.ops.name == backend
        results.append(BareLoop(runner).generate([list(range(300, 320)), list(range(500, 507))], 5, keep_logits=True))
    torch_res, triton_res = results
    assert torch_res.output_ids == triton_res.output_ids
    for a, b in zip(torch_res.step_logits, triton_res.step_logits):
        assert (a - b).abs().max().item() < 1e-4  # fp32; only summation order differs

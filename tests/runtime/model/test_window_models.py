"""Sliding windows in the dense families, as transformers applies them: Mistral's sliding_window on
every layer, Qwen2's on the layers from max_window_layers on (use_sliding_window), against
transformers in fp32 on a prompt past the window; the C++ decode step runs them (and never runs
Gemma 3's or a mixture of experts' layers)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.launch.bare_loop import BareLoop
from tandem.launch.make_tiny_model import build_tiny_model
from tandem.runtime.model.cpu_decode_step import CpuDecodeStep
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(600)

LOGIT_ATOL = 1e-3
PROMPT = list(range(200, 260))


def _runner(path: str, backend: str = "cpu") -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, max_total_tokens=2048, max_running_requests=4, dtype="float32",
                                  attention_backend=backend))


@pytest.mark.parametrize("arch, settings, windows", [
    ("mistral", {"sliding_window": 16}, (16, 16)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}, (0, 12)),
])
def test_windows_equal_transformers(tmp_path, arch, settings, windows):
    path = str(build_tiny_model(tmp_path / arch, arch, **settings))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = _runner(path)
    assert runner.config.layer_windows == windows
    loop, row = BareLoop(runner), runner.req_to_token_pool.alloc()
    try:
        ours = loop.prefill([PROMPT], [row], all_logits=True)
    finally:
        loop.release([row], [len(PROMPT)])
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
        want = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                           do_sample=False, max_new_tokens=16)[0, len(PROMPT):].tolist()
    assert (ours - ref).abs().max().item() < LOGIT_ATOL
    assert not torch.allclose(ours, _full_attention_logits(tmp_path, path), atol=LOGIT_ATOL)  # the window mattered
    assert CpuDecodeStep.build(runner.model, runner.attn_backend) is not None  # decode runs in C++, windows and all
    assert loop.generate([PROMPT], 16).output_ids[0] == want


def _full_attention_logits(tmp_path, path: str) -> torch.Tensor:
    import json
    import shutil

    dst = tmp_path / "no_window"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(sliding_window=None, use_sliding_window=False, layer_types=None)
    (dst / "config.json").write_text(json.dumps(cfg))
    runner = _runner(str(dst))
    loop, row = BareLoop(runner), runner.req_to_token_pool.alloc()
    try:
        return loop.prefill([PROMPT], [row], all_logits=True)
    finally:
        loop.release([row], [len(PROMPT)])


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe", "mixtral"])
def test_the_cpu_decode_step_leaves_other_layers_to_the_modules(tiny_model_dir, arch):
    runner = _runner(tiny_model_dir(arch))
    assert CpuDecodeStep.build(runner.model, runner.attn_backend) is None

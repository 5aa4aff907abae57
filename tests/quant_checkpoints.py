"""What the quantized-checkpoint tests share: writing a quantized folder beside a plain one holding
the same (dequantized) weights, a float32 runner for either, and a prompt's teacher-forced logprobs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs


def save_pair(src: Path, quant: Path, plain: Path, qweights: dict, refs: dict, qc: dict) -> tuple[Path, Path]:
    """`src`'s folder twice: with `qweights` and `quantization_config` qc, and with `refs` and none."""
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    for folder, tensors, cfg in ((quant, qweights, config | {"quantization_config": qc}), (plain, refs, config)):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(cfg))
    return quant, plain


def fp32_runner(path: Path, quantization: str | None = None) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=512, max_running_requests=4,
                                  dtype="float32", quantization=quantization))


def prefill_logprobs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of every position's logits, the prompt prefilled whole."""
    row = runner.req_to_token_pool.alloc()
    loop = BareLoop(runner)
    try:
        return torch.log_softmax(loop.prefill([ids], [row], all_logits=True).double(), -1)
    finally:
        loop.release([row], [len(ids)])

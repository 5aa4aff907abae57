"""A step's logits are the same bits with one intra-op thread as with two: CpuShare
(runtime/scheduler/cpu_share.py) changes the count under the forward while a machine is loaded,
and that must never change an answer. Every CPU op splits its work by rows, never by the
reduction: the packed linears (oneDNN bf16, MKL or oneDNN fp32), the C++ decode step and
attention, norms, the LM head."""
from __future__ import annotations

import pytest
import torch

from tandem.launch.bare_loop import BareLoop

PROMPTS = [[(i * 37 + t * 11) % 40000 + 100 for t in range(5 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def smol_bf16_runner():
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.server_args import ServerArgs

    return ModelRunner(ServerArgs(max_total_tokens=4096, max_running_requests=8, dtype="bfloat16"))


def _logits(runner, threads: int) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return BareLoop(runner).generate(PROMPTS, 6, keep_logits=True).step_logits
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_and_decode_logits_do_not_depend_on_the_thread_count(dtype, smol_runner, request):
    runner = smol_runner if dtype == "float32" else request.getfixturevalue("smol_bf16_runner")
    one, two = _logits(runner, 1), _logits(runner, 2)
    assert len(one) == len(two) == 6
    for step, (a, b) in enumerate(zip(one, two)):
        assert torch.equal(a, b), (dtype, step, (a - b).abs().max().item())

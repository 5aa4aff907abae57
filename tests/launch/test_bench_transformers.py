"""The transformers peer (launch/bench_transformers.py) runs where tandem runs: the device choice
(unit-tested without a GPU: CUDA's answer is an argument, nothing is faked process-wide), inputs
following the model's device, and on CPU a real generate on the tiny model."""
from __future__ import annotations

import pytest
import torch

from tandem.launch import bench_transformers
from tandem.launch.bench_transformers import pick_device


def test_auto_is_cuda_where_there_is_one_else_cpu() -> None:
    assert pick_device("auto", cuda_available=True) == "cuda"
    assert pick_device("auto", cuda_available=False) == "cpu"


def test_a_named_device_is_kept() -> None:
    assert pick_device("cpu", cuda_available=True) == "cpu"  # tandem on CPU beside a GPU: transformers too
    assert pick_device("cuda:1", cuda_available=False) == "cuda:1"


def test_auto_resolves_as_tandems_server_args_do() -> None:
    """bench offline and one-batch leave tandem's --device at auto: both sides resolve it alike."""
    from tandem.runtime.server_args import ServerArgs

    assert pick_device() == ServerArgs().resolved_device() == ServerArgs(device="auto").resolved_device()
    assert pick_device() == ("cuda" if torch.cuda.is_available() else "cpu")


class _Generation:
    pad_token_id, eos_token_id = 0, 0


class _StubModel:
    """A model on the meta device (no data, no GPU): records where generate's inputs were."""
    generation_config = _Generation()

    def __init__(self) -> None:
        self.device = torch.device("meta")
        self.seen: list[tuple[torch.device, torch.device]] = []

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, streamer=None,
                 **_: object) -> torch.Tensor:
        self.seen.append((input_ids.device, attention_mask.device))
        if streamer is not None:
            for _step in range(max_new_tokens + 1):  # the prompt, then each new token
                streamer.put(torch.zeros(1))
        return torch.zeros(input_ids.shape[0], input_ids.shape[1] + max_new_tokens, dtype=torch.long)


def test_inputs_go_to_the_models_device() -> None:
    model = _StubModel()
    bench_transformers._generate(model, [[5, 6, 7], [8]], 3, pad_id=0)
    bench_transformers.one_batch(model, [[5, 6, 7], [8]], 4, repeats=1)
    assert model.seen and all(d == (torch.device("meta"),) * 2 for d in model.seen)


@pytest.mark.timeout(300)
def test_run_on_cpu_loads_there_and_counts_the_padded_tokens(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    model = bench_transformers.load_hf_model(path, "float32", device="cpu")
    assert model.device.type == "cpu" and model.dtype == torch.float32
    del model
    seconds, computed = bench_transformers.run(path, "float32", [([[20, 21, 22], [23, 24]], [3, 2]), ([[25]], [1])],
                                               device="cpu")
    assert seconds > 0 and computed == 2 * 3 + 1

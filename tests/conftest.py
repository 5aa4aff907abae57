"""Session-wide test setup: Triton runs in its interpreter on machines without a GPU, and every
scheduler a test starts raises if it goes idle holding KV memory (so each e2e test is also a
leak check), and a SIGTERM to pytest still stops every server the session started."""
from __future__ import annotations

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # test helpers (server_utils) import by plain name

if not torch.cuda.is_available():
    # must be set before triton is first imported anywhere in the session
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("TANDEM_STRICT_MEM_CHECK", "1")

import pytest  # noqa: E402


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# `timeout 900 pytest ...` (or a CI runner giving up) sends SIGTERM, which ends Python at once:
# no fixture teardown, and the servers a session started (own process groups) lived on, 2 GB
# each. As an interrupt, pytest tears the session down and every server is stopped.
signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Return a builder of tiny random HF checkpoints, one folder per architecture, made once."""
    from tandem.launch.make_tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return lambda arch="qwen2": str(build_tiny_model(root / arch, arch))


@pytest.fixture(scope="session")
def smol_runner():
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.server_args import ServerArgs

    # the dequantized fp32 path: the one compared with transformers (the quantized default is
    # compared with this path in tests/runtime/model/test_gguf_quantized.py)
    return ModelRunner(ServerArgs(max_total_tokens=16384, max_running_requests=16, dtype="float32",
                                  quantization="none"))


@pytest.fixture(scope="session")
def smol_tokenizer():
    from tandem.runtime.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def hf_smol():
    """transformers' own model on the same GGUF checkpoint: the correctness reference."""
    import os

    from transformers import AutoModelForCausalLM

    from tandem.runtime.model_files import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()

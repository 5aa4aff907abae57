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


def test_end_tokens_are_config_and_generation_config_together(tmp_path):
    """As SGLang: Llama-3-style checkpoints list their end-of-turn tokens in generation_config.json only."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": 5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_hf_folder(tmp_path).eos_token_ids == (5,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 8, 9, 8]}))
    assert ModelConfig.from_hf_folder(tmp_path).eos_token_ids == (5, 8, 9)


def test_default_model_config_is_smollm2():
    cfg = loader.load_config(default_model_path())
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings

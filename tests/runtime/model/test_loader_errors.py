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


def _copy_model(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_corrupt_files_are_one_error_naming_the_file(tiny_model_dir, tmp_path):
    import torch

    cut = _copy_model(tiny_model_dir("llama"), tmp_path / "cut")
    data = (tmp_path / "cut" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"cut/model\.safetensors: not a readable safetensors file"):
        loader.load_model(cut, torch.float32)
    bad_json = _copy_model(tiny_model_dir("llama"), tmp_path / "json")
    (tmp_path / "json" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"json/config\.json: not valid JSON"):
        loader.load_config(bad_json)
    for name, content in (("garbage.gguf", b"\x00" * 64), ("cut.gguf", open(default_model_path(), "rb").read(1 << 20))):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"{name}: not a readable GGUF file"):
            loader.load_config(str(tmp_path / name))


def test_unsupported_architecture_names_the_file(tmp_path):
    import gguf
    import numpy as np

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config\.json: unsupported model architecture 'GPT2LMHeadModel'"):
        loader.load_config(str(tmp_path))
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf: unsupported GGUF architecture 'gpt2'"):
        loader.load_config(path)


def _tiny_llama_gguf(path: str, extra: str) -> str:
    """A one-layer Llama GGUF (float32) with one more tensor named `extra`."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2), ("vocab_size", 10)):
        writer.add_uint32(f"llama.{key}", value)
    shapes = {"token_embd": (10, 8), "output_norm": (8,), "blk.0.attn_norm": (8,), "blk.0.ffn_norm": (8,),
              "blk.0.attn_q": (8, 8), "blk.0.attn_k": (8, 8), "blk.0.attn_v": (8, 8), "blk.0.attn_output": (8, 8),
              "blk.0.ffn_gate": (16, 8), "blk.0.ffn_up": (16, 8), "blk.0.ffn_down": (8, 16), extra: (2,)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", np.ones(shape, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


def test_gguf_tensors_tandem_does_not_read(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    # llama.cpp's Llama 3 rope factors are skipped, as transformers' GGUF loader skips them
    loader.load_model(_tiny_llama_gguf(str(tmp_path / "freqs.gguf"), "rope_freqs"), torch.float32)
    with pytest.raises(ValueError, match=r"other\.gguf: tensor 'blk\.0\.attn_foo\.weight' is not one tandem reads"):
        loader.load_model(_tiny_llama_gguf(str(tmp_path / "other.gguf"), "blk.0.attn_foo"), torch.float32)


def test_checkpoint_weights_the_config_does_not_use_are_refused(tiny_model_dir, tmp_path):
    """A bias the config does not declare would otherwise be dropped: every answer wrong, silently."""
    import torch
    from safetensors.torch import load_file, save_file

    path = _copy_model(tiny_model_dir("llama"), tmp_path / "extra")
    weights = load_file(str(tmp_path / "extra" / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # old checkpoints: recomputed
    save_file(weights, str(tmp_path / "extra" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"extra: checkpoint has weights its LlamaForCausalLM config does not use: "
                                         r"\['model\.layers\.0\.self_attn\.o_proj\.bias'\]"):
        loader.load_model(path, torch.float32)

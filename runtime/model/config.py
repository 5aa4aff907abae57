"""Model configuration read from a Hugging Face folder or a GGUF file."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tandem.runtime.model_files import generation_config

# each supported architecture and its config.json model_type
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "MistralForCausalLM": "mistral"}
SUPPORTED_ARCHS = tuple(MODEL_TYPES)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: dict | None = None

    @staticmethod
    def from_hf_dict(cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model architecture {arch!r}; tandem supports {', '.join(SUPPORTED_ARCHS)}")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            rope_scaling=cfg.get("rope_scaling"),
        )

    @staticmethod
    def from_hf_folder(path: Path) -> "ModelConfig":
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        config = ModelConfig.from_hf_dict(json.loads(config_file.read_text()))
        # as SGLang: the end tokens are config.json's and generation_config.json's together
        extra = generation_config(str(path)).get("eos_token_id")
        extra_ids = extra if isinstance(extra, list) else ([extra] if isinstance(extra, int) else [])
        eos_ids = config.eos_token_ids + tuple(i for i in dict.fromkeys(extra_ids) if i not in config.eos_token_ids)
        return dataclasses.replace(config, eos_token_ids=eos_ids)

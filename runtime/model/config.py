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
# the rope types RotaryEmbedding computes as transformers does; any other would silently rotate wrong
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    o_bias: bool = False  # o_proj's bias (Llama and Qwen3 with attention_bias)
    mlp_bias: bool = False  # gate/up/down biases (Llama's mlp_bias)

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
        max_position = cfg.get("max_position_embeddings", 4096)
        rope_theta, rope_scaling = _rope(cfg, max_position)
        # transformers' Llama and Qwen3 bias q/k/v/o with attention_bias; Qwen2 biases q/k/v always, Mistral never
        attention_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and bool(cfg.get("attention_bias", False))
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
            rope_theta=rope_theta,
            max_position=_context_positions(max_position, rope_scaling),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            rope_scaling=rope_scaling,
            o_bias=attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
        )

    @staticmethod
    def from_hf_folder(path: Path) -> "ModelConfig":
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{config_file}: not valid JSON ({e})") from e
        try:
            config = ModelConfig.from_hf_dict(raw)
        except KeyError as e:
            raise ValueError(f"{config_file}: lacks {e}") from None
        except ValueError as e:
            raise ValueError(f"{config_file}: {e}") from None
        # as SGLang: the end tokens are config.json's and generation_config.json's together
        extra = generation_config(str(path)).get("eos_token_id")
        extra_ids = extra if isinstance(extra, list) else ([extra] if isinstance(extra, int) else [])
        eos_ids = config.eos_token_ids + tuple(i for i in dict.fromkeys(extra_ids) if i not in config.eos_token_ids)
        return dataclasses.replace(config, eos_token_ids=eos_ids)


def _rope(cfg: dict, max_position: int) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either config.json layout: transformers 5 writes one
    `rope_parameters` dict holding the theta and the scaling, earlier versions `rope_theta` and
    `rope_scaling` beside each other. A type this model cannot compute is refused, naming the field."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = dict(cfg.get(field) or {})
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json {field}.rope_type {rope_type!r} is not supported; tandem supports "
                         f"{', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {partial} is not supported (rotary over the whole head only)")
    if rope_type == "default":
        return float(theta), None
    if rope_type in ("llama3", "yarn"):  # transformers' default for the pretraining length
        params.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings") or max_position)
    return float(theta), params | {"rope_type": rope_type}


def _context_positions(max_position: int, rope_scaling: dict | None) -> int:
    """As SGLang's get_context_length: a linear scaling without a pretraining length stretches
    max_position_embeddings by its factor; the other types state their length already."""
    if rope_scaling and rope_scaling["rope_type"] == "linear" and "original_max_position_embeddings" not in rope_scaling:
        return int(max_position * rope_scaling.get("factor", 1))
    return max_position

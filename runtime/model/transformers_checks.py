"""--model-impl: which implementation serves a checkpoint, and what the transformers one refuses
at start (before any weight is read), each refusal naming its reason.

SGLang's choice: `sglang` (tandem's own classes, here) serves only the architectures tandem has
a class for; `transformers` builds any causal LM transformers has, through transformers' modeling
code (runtime/model/transformers_impl.py); `auto` keeps tandem's class where there is one and
falls back to transformers for every other architecture.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.runtime.model.config import ModelConfig, has_native_class
from tandem.runtime.model_files import generation_config, is_gguf

MODEL_IMPLS = ("auto", "sglang", "transformers")
# transformers' model types whose layers keep a recurrent or state-space state (or convolve over
# tokens): that state lives outside the KV pool, so the radix cache and retraction cannot hold it
_RECURRENT_MODEL_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba",
                          "falcon_h1", "nemotron_h", "granitemoehybrid", "lfm2", "lfm2_moe", "recurrent_gemma",
                          "xlstm", "qwen3_next", "minimax", "plamo2", "hunyuan_v1_moe_linear", "kimi_linear")
# layer types that attend (transformers' layer_types); any other names a recurrent or linear-attention layer
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def uses_transformers(model_impl: str, model_path: str) -> bool:
    """Whether `model_impl` ("auto", "sglang", "transformers") runs the checkpoint at `model_path`
    through transformers' modeling code. A GGUF file is tandem's own classes' always."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"--model-impl: {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    if model_impl == "sglang":
        return False
    if is_gguf(model_path):
        if model_impl == "transformers":
            raise ValueError(f"--model-impl transformers reads a Hugging Face folder (config.json and safetensors); "
                             f"{model_path} is a GGUF file, which tandem's own classes serve (--model-impl auto)")
        return False
    if model_impl == "transformers":
        return True
    return not has_native_class(_architecture(Path(model_path)))


def _architecture(folder: Path) -> str:
    import json

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json")
    try:
        archs = json.loads(config_file.read_text()).get("architectures") or [""]
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from e
    return archs[0]


def hf_config(model_path: str) -> Any:
    """transformers' config of the checkpoint, checked for what the transformers implementation
    cannot serve. tandem runs no code from a checkpoint (--trust-remote-code is ignored)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{model_path}: transformers cannot read this config ({e}); --model-impl transformers "
                         f"serves architectures transformers itself has (no checkpoint code is run)") from None
    check_servable(config)
    return config


def check_servable(config: Any) -> None:
    """Refuse, naming the reason, a config whose model keeps state outside attention's K/V
    (recurrent, state-space or linear-attention layers), an encoder-decoder, or attention that
    tandem's backends do not compute (softcapped scores, chunked attention)."""
    text = config.get_text_config()
    model_type = getattr(text, "model_type", "") or ""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model type {model_type!r} is an encoder-decoder; --model-impl transformers serves "
                         f"decoder-only causal LMs")
    if model_type in _RECURRENT_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} has recurrent or state-space layers, whose state tandem's "
                         f"KV cache cannot hold; --model-impl transformers serves attention-only models")
    other = sorted({t for t in (getattr(text, "layer_types", None) or []) if t not in _ATTENTION_LAYER_TYPES})
    if other:
        raise ValueError(f"config layer_types has {', '.join(map(repr, other))} layers (recurrent, state-space or "
                         f"linear attention), whose state tandem's KV cache cannot hold")
    for field, why in (("attn_logit_softcapping", "attention-score softcapping"),
                       ("attention_chunk_size", "chunked attention")):
        if getattr(text, field, None):
            raise ValueError(f"config {field} ({why}) is not supported by tandem's attention backends")


def check_model_class(model_class: type) -> None:
    """The class must hand its attention to the attention interface (transformers' flag)."""
    if not getattr(model_class, "_supports_attention_backend", False):
        raise ValueError(f"transformers' {model_class.__name__} does not support a custom attention backend "
                         f"(_supports_attention_backend is not set), so tandem's paged attention cannot run inside it")


def model_config(model_path: str, config: Any | None = None) -> ModelConfig:
    """What the runner sizes the KV pool and the scheduler by, from transformers' config."""
    config = config if config is not None else hf_config(model_path)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    max_position = next((v for v in (getattr(text, f, None) for f in
                                     ("max_position_embeddings", "n_positions", "max_sequence_length")) if v), 2048)
    eos_ids = _ids(getattr(text, "eos_token_id", None) or getattr(config, "eos_token_id", None))
    extra = [i for i in _ids(generation_config(model_path).get("eos_token_id")) if i not in eos_ids]
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    return ModelConfig(
        arch=archs[0], vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", None) or 0, num_layers=text.num_hidden_layers,
        num_heads=heads, num_kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
        rms_norm_eps=0.0, rope_theta=0.0, max_position=int(max_position),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)), qkv_bias=False, qk_norm=False,
        eos_token_ids=(*eos_ids, *extra),
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None) or None)


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(v for v in value if isinstance(v, int))) if isinstance(value, (list, tuple)) else ()

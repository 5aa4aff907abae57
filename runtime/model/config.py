"""Model configuration read from a Hugging Face folder or a GGUF file."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tandem.runtime.model_files import generation_config

# each supported architecture and its config.json model_type
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "MistralForCausalLM": "mistral", "Gemma3ForCausalLM": "gemma3_text",
               "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
SUPPORTED_ARCHS = tuple(MODEL_TYPES)
MOE_ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# architectures transformers has that tandem refuses with a pointer to what it does serve
_REFUSED = {"Gemma3ForConditionalGeneration": "Gemma 3's vision-language model: tandem serves its text model only "
                                              "(Gemma3ForCausalLM, as the 270M and 1B checkpoints are)"}


def has_native_class(arch: str) -> bool:
    """Whether tandem's own classes decide `arch`: they serve it, or refuse it with a reason of their
    own (--model-impl auto runs every other architecture through transformers)."""
    return arch in SUPPORTED_ARCHS or arch in _REFUSED


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
    # per layer, the keys a query attends to (its sliding window, transformers' sliding_window);
    # 0 = every key, () = no layer has a window
    layer_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (Gemma's)
    attn_scale: float | None = None  # scores' scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # the rope of the window layers where it differs from the global layers' (Gemma 3's local base)
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    # mixture of experts (Qwen3-MoE, Mixtral): experts, experts per token, each expert's width,
    # whether the top-k weights are renormalized to sum to 1, and the layers with a dense MLP instead
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        """Which module set builds the model: "llama" (the dense families and MoE) or "gemma3"."""
        return "gemma3" if self.arch == "Gemma3ForCausalLM" else "llama"

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts > 0 and layer_id not in self.dense_layers

    def window(self, layer_id: int) -> int:
        return self.layer_windows[layer_id] if self.layer_windows else 0

    @staticmethod
    def from_hf_dict(cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch in _REFUSED:
            raise ValueError(f"unsupported model architecture {arch!r}: {_REFUSED[arch]}")
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model architecture {arch!r}; tandem supports {', '.join(SUPPORTED_ARCHS)}")
        if arch == "Gemma3ForCausalLM":
            return _gemma3(cfg)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        max_position = cfg.get("max_position_embeddings", 4096)
        rope_theta, rope_scaling = _rope(cfg, max_position)
        # transformers' Llama and Qwen3 (-MoE) bias q/k/v/o with attention_bias; Qwen2 biases q/k/v always,
        # Mistral and Mixtral never
        qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        attention_bias = (arch == "LlamaForCausalLM" or qwen3) and bool(cfg.get("attention_bias", False))
        config = ModelConfig(
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
            qk_norm=qwen3,
            eos_token_ids=eos_ids,
            rope_scaling=rope_scaling,
            o_bias=attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
            layer_windows=_layer_windows(cfg, arch),
        )
        _check_act(cfg.get("hidden_act", "silu"), ("silu",))
        return _with_experts(config, cfg) if arch in MOE_ARCHS else config

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


def _check_act(act: str, allowed: tuple[str, ...]) -> None:
    if act not in allowed:
        raise ValueError(f"config.json hidden_act {act!r} is not supported; tandem computes {', '.join(allowed)} here")


def _layer_windows(cfg: dict, arch: str) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it: Mistral's and Mixtral's
    sliding_window on every layer; the Qwens' only with use_sliding_window, on the layers
    layer_types names (by default those from max_window_layers on; Qwen3-MoE: all)."""
    window, layers = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (int(window),) * layers if window else ()
    if not (arch.startswith("Qwen") and cfg.get("use_sliding_window") and window):
        return ()
    types = cfg.get("layer_types")
    if arch == "Qwen3MoeForCausalLM":
        types = ["sliding_attention"] * layers
    elif types is None:
        first = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)


def _with_experts(config: ModelConfig, cfg: dict) -> ModelConfig:
    """Qwen3-MoE's and Mixtral's expert settings. Mixtral's experts are intermediate_size wide and
    their top-k weights always renormalized; Qwen3-MoE's are moe_intermediate_size wide, renormalized
    with norm_topk_prob, and mlp_only_layers / decoder_sparse_step name dense layers."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    if not 0 < top_k <= experts:
        raise ValueError(f"config.json needs num_experts (or num_local_experts) and 0 < num_experts_per_tok <= it, "
                         f"got {experts} and {top_k}")
    if config.arch == "MixtralForCausalLM":
        return dataclasses.replace(config, num_experts=experts, num_experts_per_tok=top_k,
                                   moe_intermediate_size=config.intermediate_size, norm_topk_prob=True)
    step = cfg.get("decoder_sparse_step") or 1
    dense = tuple(i for i in range(config.num_layers)
                  if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step)
    return dataclasses.replace(config, num_experts=experts, num_experts_per_tok=top_k,
                               moe_intermediate_size=cfg["moe_intermediate_size"],
                               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)


def _gemma3(cfg: dict) -> ModelConfig:
    """Gemma 3's text model, with transformers' Gemma3TextConfig defaults for what the file leaves out."""
    for field, why in (("attn_logit_softcapping", "attention-score softcapping"),
                       ("use_bidirectional_attention", "bidirectional attention")):
        if cfg.get(field):
            raise ValueError(f"config.json {field} ({why}) is not supported")
    _check_act(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
               ("gelu_pytorch_tanh", "gelu_tanh"))
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6)
                                       else "full_attention" for i in range(layers)]
    window = int(cfg.get("sliding_window") or 4096)
    max_position = cfg.get("max_position_embeddings", 131072)
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one rope per layer type
        theta, scaling = _rope({"rope_parameters": params.get("full_attention") or {"rope_theta": 1e6}}, max_position)
        local_theta, local_scaling = _rope({"rope_parameters": params.get("sliding_attention") or {}}, max_position)
    else:
        theta, scaling = _rope({"rope_theta": 1e6, **cfg}, max_position)
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq") or 10000.0), None
    heads, hidden = cfg.get("num_attention_heads", 8), cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or 256
    eos = cfg.get("eos_token_id", 1)
    return ModelConfig(
        arch="Gemma3ForCausalLM", vocab_size=cfg.get("vocab_size", 262208), hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
        max_position=_context_positions(max_position, scaling),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        rope_scaling=scaling, o_bias=bool(cfg.get("attention_bias", False)),
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        hidden_act="gelu_tanh", attn_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        local_rope_theta=local_theta, local_rope_scaling=local_scaling)


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

"""Find the model, read its config and weights (HF safetensors folder or GGUF file) into `CausalLM`."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from tandem.runtime.model.config import SUPPORTED_ARCHS, ModelConfig
from tandem.runtime.model.gemma3 import Gemma3ForCausalLM
from tandem.runtime.model.llama import CausalLM
from tandem.runtime.model.quant import gguf_load, gptq_awq, w8a8_int8
from tandem.runtime.model.tensor_parallel import SINGLE, TensorParallel, check_divisible, shard_weights
from tandem.runtime.model_files import file_cache_key, is_gguf

_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def load_config(model_path: str) -> ModelConfig:
    if is_gguf(model_path):
        return _gguf_file_config(model_path, file_cache_key(model_path))
    return ModelConfig.from_hf_folder(Path(model_path))


@lru_cache(maxsize=8)
def _gguf_file_config(model_path: str, file_key: str) -> ModelConfig:
    """One GGUF file version's config, parsed once a process: gguf's reader walks every metadata
    field (the tokenizer's vocabulary too). `file_key` changes when the file does."""
    try:
        return _gguf_config(_gguf_reader(model_path))
    except ValueError as e:
        raise ValueError(e if str(e).startswith(model_path) else f"{model_path}: {e}") from None


def load_model(model_path: str, dtype: torch.dtype, device: torch.device | str = "cpu",
               tp: TensorParallel = SINGLE, quantization: str | None = "none") -> CausalLM:
    """`quantization`: --quantization (runtime/model/quant/gguf_load.py, gptq_awq.py, w8a8_int8.py);
    "none" dequantizes a GGUF or a GPTQ/AWQ/w8a8_int8 checkpoint."""
    cfg = load_config(model_path)
    check_divisible(cfg, tp.size)
    with torch.device("meta"):
        model = (Gemma3ForCausalLM if cfg.family == "gemma3" else CausalLM)(cfg, tp)
    quantized = gptq_awq.checkpoint_format(model_path, quantization)
    plan = gguf_load.GgufPlan() if gguf_load.wanted(quantization, model_path, device, tp.size) else None
    raw = _gguf_weights(model_path, cfg, plan) if plan is not None else load_hf_weights(model_path, cfg)
    if quantized is not None:  # GPTQ/AWQ linears -> GGUF int4 rows, w8a8_int8's kept int8 (or dequantized)
        keep = gptq_awq.served(quantized, quantization, device, tp.size)
        plan = (w8a8_int8.convert(raw, keep) if quantized.method == w8a8_int8.METHOD
                else gptq_awq.convert(raw, quantized, keep))
    if plan is not None and not isinstance(plan, w8a8_int8.Int8Plan):
        plan.pack_groups(raw)  # fused linears of mixed types: packed as groups, not fused as rows
    weights = shard_weights(_fuse(raw, cfg), cfg, tp)
    held = plan.take(weights) if plan is not None else {}
    _load_into(model, weights, dtype, device, model_path, held=held.keys())
    if isinstance(plan, w8a8_int8.Int8Plan):
        w8a8_int8.install(model, held)
    else:
        gguf_load.install(model, held, dtype)
        if held and quantized is not None:  # /server_info says "gptq:q4_0", not the GGUF file type it is not
            model.checkpoint_quantization = quantized.method
    model.build_rotary(device)  # its tables were made on the meta device
    return model.eval()


def load_hf_weights(model_path: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under Hugging Face names (a GGUF dequantized to float32)."""
    return _gguf_weights(model_path, cfg) if is_gguf(model_path) else _hf_weights(Path(model_path))


def _load_into(model: CausalLM, weights: dict[str, torch.Tensor], dtype: torch.dtype, device,
               model_path: str, held=()) -> None:
    """`held`: names of weights kept quantized, installed after (gguf_load.install)."""
    expected = {name for name, _ in model.named_parameters()} - set(held)
    missing = expected - weights.keys()
    if missing:
        raise ValueError(f"{model_path}: checkpoint lacks weights: {_some(missing)}")
    # a weight nothing reads (a bias the config does not declare, say) would change no answer
    # silently; rotary caches that old checkpoints saved are recomputed, as SGLang skips them
    unused = {name for name in weights.keys() - expected if "rotary_emb." not in name}
    if unused:
        raise ValueError(f"{model_path}: checkpoint has weights its {model.cfg.arch} config does not use: "
                         f"{_some({_checkpoint_name(name) for name in unused})}")
    params = {name: torch.nn.Parameter(weights[name].to(device=device, dtype=dtype), requires_grad=False)
              for name in expected}
    for name, param in params.items():
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, param)


def _some(names: set[str]) -> str:
    return f"{sorted(names)[:5]}{' ...' if len(names) > 5 else ''}"


def _checkpoint_name(name: str) -> str:
    """A fused name as the checkpoint spells it (_fuse in reverse), for errors."""
    name = name.replace("experts.gate_up_proj", "experts.N.{gate,up}_proj.weight")
    name = name.replace("experts.down_proj", "experts.N.down_proj.weight")
    name = name.replace("qkv_proj", "{q,k,v}_proj").replace("gate_up_proj", "{gate,up}_proj")
    name = name.replace("_proj_bias", "_proj.bias")
    return name if name.startswith("lm_head.") else f"model.{name}"


def _fuse(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names (model.layers.N.self_attn.q_proj.weight, ...) -> tandem's fused names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        out[_mixtral_to_qwen_names(name.removeprefix("model."))] = tensor
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):
            _stack_experts(out, f"layers.{i}.mlp.experts", cfg.num_experts)
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        for kind in ("weight", "bias"):
            parts = [out.pop(f"{attn}.{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{attn}.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        for kind in ("weight", "bias"):
            gate, up = out.pop(f"{mlp}.gate_proj.{kind}", None), out.pop(f"{mlp}.up_proj.{kind}", None)
            if gate is not None and up is not None:
                out[f"{mlp}.gate_up_proj.{kind}"] = torch.cat([gate, up], dim=0)
        # row-parallel biases live beside their linears (llama.py adds them after the all-reduce)
        for old, new in ((f"{attn}.o_proj.bias", f"{attn}.o_proj_bias"), (f"{mlp}.down_proj.bias", f"{mlp}.down_proj_bias")):
            if old in out:
                out[new] = out.pop(old)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _mixtral_to_qwen_names(name: str) -> str:
    """Mixtral's block_sparse_moe.experts.N.w1/w3/w2 (gate, up, down) under Qwen3-MoE's names."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
        name = name.replace(old, new)
    return name


def _stack_experts(out: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """Expert e's gate/up/down weights -> `gate_up_proj` [E, 2I, H] ([gate; up] rows per expert) and
    `down_proj` [E, H, I]. A checkpoint that holds them stacked already (transformers 5's layout)
    keeps them; one that lacks an expert keeps what it has, for _load_into to name."""
    parts = {proj: [out.pop(f"{prefix}.{e}.{proj}.weight", None) for e in range(num_experts)]
             for proj in ("gate_proj", "up_proj", "down_proj")}
    if all(t is not None for ts in parts.values() for t in ts):
        gate_up = [torch.cat([gate, up]) for gate, up in zip(parts["gate_proj"], parts["up_proj"])]
        out[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.down_proj"] = torch.stack(parts["down_proj"])
        return
    for proj, tensors in parts.items():
        for e, t in enumerate(tensors):
            if t is not None:
                out[f"{prefix}.{e}.{proj}.weight"] = t


def _hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {folder} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as e:  # safetensors' errors name neither the file nor, some, anything
            raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    return weights


def _gguf_reader(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # gguf's errors ("GGUF magic invalid", numpy's on a cut file) name no file
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_config(reader) -> ModelConfig:
    arch_name = _field(reader, "general.architecture")
    if arch_name not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r}; tandem supports {', '.join(_GGUF_ARCHS)}")
    p = arch_name + "."
    heads = _field(reader, p + "attention.head_count")
    hidden = _field(reader, p + "embedding_length")
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    extra = {}
    if arch_name == "gemma3":  # what transformers' GGUF reader takes; the rest are Gemma3TextConfig's defaults
        extra = {"sliding_window": _field(reader, p + "attention.sliding_window"),
                 "rope_scaling": _gguf_rope_scaling(reader, p)}
    return ModelConfig.from_hf_dict(extra | {
        "architectures": [_GGUF_ARCHS[arch_name]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, p + "feed_forward_length"),
        "num_hidden_layers": _field(reader, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, p + "attention.head_count_kv", heads),
        "head_dim": _field(reader, p + "attention.key_length", hidden // heads),
        "rms_norm_eps": _field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, p + "rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, p + "context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "eos_token_id": eos,
    })


def _gguf_rope_scaling(reader, p: str) -> dict | None:
    """llama.cpp's linear rope scaling (Gemma 3 4B and up scale their global layers by 8)."""
    kind, factor = _field(reader, p + "rope.scaling.type"), _field(reader, p + "rope.scaling.factor")
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    if kind != "linear":
        raise ValueError(f"GGUF {p}rope.scaling.type {kind!r} is not supported for this architecture")
    return {"rope_type": "linear", "factor": float(factor)}


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms a layer: llama.cpp's ffn_norm is its pre-feedforward norm
_GGUF_GEMMA3_NAMES = _GGUF_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_weights(path: str, cfg: ModelConfig, plan: gguf_load.GgufPlan | None = None) -> dict[str, torch.Tensor]:
    """Float32 tensors, dequantized from the file's memory map on every load (gguf's numpy
    dequantize takes ~1 s for a 135M model; no float32 copy is kept on disk); with a `plan`, the
    tensors it keeps are the file's uint8 rows."""
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    arch_name = _field(reader, "general.architecture")
    llama_layout = arch_name in ("llama", "mistral")
    # llama.cpp stores Gemma's norm weights as 1 + weight; transformers' reader subtracts the 1 again
    gemma = arch_name == "gemma3"
    names = _GGUF_GEMMA3_NAMES if gemma else _GGUF_NAMES
    weights: dict[str, torch.Tensor] = {}

    def hf_name(t) -> str | None:
        stem, _, kind = t.name.rpartition(".")
        part = stem.split(".", 2)[2] if stem.startswith("blk.") else stem
        if part == "rope_freqs":  # llama.cpp's Llama 3 rope factors: transformers' GGUF loader skips them too
            return None
        if part not in names:
            raise ValueError(f"{path}: tensor {t.name!r} is not one tandem reads")
        return f"model.layers.{stem.split('.')[1]}.{names[part]}.{kind}" if stem.startswith("blk.") \
            else f"{names[part]}.{kind}"

    if plan is not None:
        plan.fill(reader, hf_name)
    for t in reader.tensors:
        if (name := hf_name(t)) is None:
            continue
        stem = t.name.rpartition(".")[0]
        part = stem.split(".", 2)[2] if stem.startswith("blk.") else stem
        if plan is not None and plan.keeps(name):
            array = np.array(t.data)  # the file's blocks, [out, in / 32 * block bytes] uint8: rows reorder alike
        else:
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            array = array.reshape([int(d) for d in reversed(t.shape)])  # ggml lists dims innermost first
        if llama_layout and stem.endswith("attn_q"):
            array = _unpermute_rope(array, cfg.num_heads)
        elif llama_layout and stem.endswith("attn_k"):
            array = _unpermute_rope(array, cfg.num_kv_heads)
        elif gemma and part.endswith("norm"):
            array = array - 1.0
        weights[name] = torch.from_numpy(np.ascontiguousarray(array) if array.flags.writeable else array.copy())
    return weights


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores Llama q/k rows interleaved per head for its rotary; undo it to the HF halves layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


__all__ = ["SUPPORTED_ARCHS", "load_config", "load_model"]

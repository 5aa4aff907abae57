"""Build a tiny random checkpoint (HF folder: config.json + safetensors + tokenizer) for tests,
or a layer-truncated copy of a checkpoint (a draft model for STANDALONE speculation).

`python -m tandem.launch.make_tiny_model OUT_DIR --arch qwen2` writes a tiny one (gemma3: window
layers of 16 keys beside global ones, softcapped logits; qwen3_moe and mixtral: 8 experts, 2 a token);
`... OUT_DIR --truncate-from MODEL --layers 4` a truncated copy. Tests call `build_tiny_model` /
`build_truncated_model` directly. The tokenizer is the embedded SmolLM2 one, so vocab is 49152.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
GEMMA3_WINDOW = 16  # the tiny Gemma 3's sliding window: short prompts already reach past it


def _arch_settings(arch: str, hidden: int, layers: int) -> dict:
    """What a tiny model of `arch` sets beyond the shared sizes, so its own pieces are exercised."""
    if arch == "gemma3":  # every other layer a window layer; a scale and a logit cap of its own
        return {"sliding_window": GEMMA3_WINDOW, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 24,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
    if arch == "qwen3_moe":
        return {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
                "norm_topk_prob": True}
    if arch == "mixtral":
        return {"num_local_experts": 8, "num_experts_per_tok": 2}
    return {}


def build_tiny_model(out_dir: str | Path, arch: str = "qwen2", hidden: int = 64, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, seed: int = 0, **overrides) -> Path:
    """`overrides`: config fields on top of the arch's tiny settings."""
    import transformers

    from tandem.runtime.tokenizer import load_tokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    tok = load_tokenizer(None)
    config_cls, model_cls = (getattr(transformers, name) for name in _ARCHS[arch])
    fields = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                  max_position_embeddings=2048, rms_norm_eps=1e-6,
                  tie_word_embeddings=arch not in ("qwen2", "mixtral"), eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id, torch_dtype="float32")
    config = config_cls(**(fields | _arch_settings(arch, hidden, layers) | overrides))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # default init is tiny (routers and Gemma's norms zero); widen it so
        for name, p in model.named_parameters():  # logits are not all near-ties and experts differ
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            if name.endswith("bias") or (arch == "gemma3" and name.endswith("norm.weight")):
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def build_truncated_model(model_path: str | None, out_dir: str | Path, layers: int, dtype: str = "float32") -> Path:
    """An HF folder holding the first `layers` layers of a checkpoint (HF folder or GGUF), its
    embeddings, final norm and head, in `dtype`: a same-tokenizer draft model for STANDALONE
    speculation, or (all layers) the checkpoint a trainer writes (bench weights)."""
    import json

    from safetensors.torch import save_file

    from tandem.runtime.model.loader import load_config, load_hf_weights
    from tandem.runtime.model_files import resolve_model_path
    from tandem.runtime.tokenizer import load_tokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    src = resolve_model_path(model_path)
    cfg = load_config(src)
    windows = set(cfg.layer_windows)
    if cfg.family != "llama" or cfg.num_experts or len(windows) > 1 or (windows and cfg.arch != "MistralForCausalLM"):
        raise ValueError(f"a truncated copy is written for the dense Llama-family layouts; {cfg.arch} "
                         f"(per-layer windows, experts or Gemma's layers) is not one")
    if not 1 <= layers <= cfg.num_layers:
        raise ValueError(f"layers must be in [1, {cfg.num_layers}], got {layers}")
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: w.to(getattr(torch, dtype)).contiguous() for name, w in load_hf_weights(src, cfg).items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    save_file(weights, str(out / "model.safetensors"))
    max_position, scaling = cfg.max_position, cfg.rope_scaling
    if scaling and scaling["rope_type"] == "linear" and "original_max_position_embeddings" not in scaling:
        max_position = int(max_position / scaling["factor"])  # the config stretches it by the factor again
    hf = {"architectures": [cfg.arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
          "intermediate_size": cfg.intermediate_size, "num_hidden_layers": layers,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
          "max_position_embeddings": max_position, "tie_word_embeddings": cfg.tie_word_embeddings,
          "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias, "eos_token_id": list(cfg.eos_token_ids),
          "torch_dtype": dtype, "sliding_window": next(iter(windows), None)}
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    load_tokenizer(model_path).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=sorted(_ARCHS), default="qwen2")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--truncate-from", default=None, help="copy the first --layers layers of this model")
    args = parser.parse_args(argv)
    if args.truncate_from:
        print(build_truncated_model(args.truncate_from, args.out_dir, args.layers))
    else:
        print(build_tiny_model(args.out_dir, args.arch, args.hidden, args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

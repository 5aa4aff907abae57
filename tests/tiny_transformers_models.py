"""Tiny random checkpoints of architectures tandem has no class of its own for (GPT-NeoX, Phi-3),
for --model-impl transformers: HF folders (config.json, safetensors, the embedded SmolLM2
tokenizer), built with transformers, no hub."""
from __future__ import annotations

from pathlib import Path

import torch

HIDDEN, LAYERS, HEADS = 64, 2, 4


def _config(arch: str, vocab: int, eos: int, bos: int, **overrides):
    import transformers

    shared = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, max_position_embeddings=2048, eos_token_id=eos, bos_token_id=bos,
                  tie_word_embeddings=False)
    if arch == "gpt_neox":  # partial rotary and parallel residual: pieces tandem's own classes lack
        return transformers.GPTNeoXConfig(**shared, rotary_pct=0.5, use_parallel_residual=True, **overrides)
    if arch == "phi3":  # fused qkv and gate_up linears, grouped KV heads
        return transformers.Phi3Config(**shared, num_key_value_heads=2, pad_token_id=eos, **overrides)
    raise ValueError(f"no tiny {arch}")


def build_tiny_transformers_model(out_dir: str | Path, arch: str = "gpt_neox", seed: int = 0, **overrides) -> Path:
    """A tiny random `arch` checkpoint in `out_dir` (made once); weights widened from the default
    init so greedy tokens are not near-ties."""
    import transformers

    from tandem.runtime.tokenizer import load_tokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    tok = load_tokenizer(None)
    config = _config(arch, len(tok), tok.eos_token_id, tok.bos_token_id, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out

"""CTranslate2 as a peer in `bench offline`: a fast C++ CPU engine, on the same weights.

The checkpoint is converted once (cached under TANDEM_CACHE_DIR): a GGUF is first dequantized by
transformers and copied into a plain model, since GGUF-quantized transformers models refuse
`save_pretrained`; then `ctranslate2.converters.TransformersConverter` writes CTranslate2's
format. Generation is greedy with each batch decoded to a fixed length (min = max), all prompts
handed to CTranslate2's own batching at once.
"""
from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import shutil
import time
from typing import Any

from tandem.runtime.envs import envs


def cache_dir() -> str:
    return os.path.join(envs.CACHE_DIR.get() or os.path.expanduser("~/.cache/tandem"), "ctranslate2")


def _plain_hf_copy(model_path: str, out_dir: str) -> None:
    """A GGUF's dequantized weights as a plain transformers folder (config, safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(model_path), os.path.basename(model_path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):  # the weights are dequantized now; converters must not see GGUF
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def converted_model(model_path: str, quantization: str) -> str:
    """The CTranslate2 folder for this checkpoint and quantization, converting on first use."""
    import ctranslate2

    key = hashlib.sha256(f"{os.path.abspath(model_path)}:{os.path.getsize(model_path) if os.path.isfile(model_path) else ''}"
                         .encode()).hexdigest()[:12]
    out = os.path.join(cache_dir(), f"{key}-{quantization}")
    if os.path.isfile(os.path.join(out, "model.bin")):
        return out
    source = model_path
    plain = os.path.join(cache_dir(), f"{key}-hf")
    if model_path.endswith(".gguf"):
        if not os.path.isfile(os.path.join(plain, "config.json")):
            _plain_hf_copy(model_path, plain + ".tmp")
            os.replace(plain + ".tmp", plain)
        source = plain
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ctranslate2.converters.TransformersConverter(source).convert(tmp, quantization=quantization)
    os.replace(tmp, out)
    return out


def run(model_path: str, prompts: list[list[int]], output_len: int, compute_type: str,
        threads: int) -> tuple[float, list[list[int]]]:
    """Seconds to generate `output_len` greedy tokens for every prompt, and the ids produced."""
    import ctranslate2

    folder = converted_model(model_path, "int8" if compute_type.startswith("int8") else "float32")
    with open(os.path.join(folder, "vocabulary.json"), encoding="utf-8") as f:
        vocabulary = json.load(f)  # the converter's id -> token list, which the generator reads back
    tokens = [[vocabulary[i] for i in prompt] for prompt in prompts]
    generator = ctranslate2.Generator(folder, device="cpu", compute_type=compute_type, intra_threads=threads)
    greedy: dict[str, Any] = dict(max_length=output_len, min_length=output_len, sampling_topk=1,
                                  include_prompt_in_result=False, max_batch_size=len(prompts))
    generator.generate_batch(tokens[:2], **{**greedy, "max_length": 4, "min_length": 4})  # warm-up
    t0 = time.perf_counter()
    results = generator.generate_batch(tokens, **greedy)
    seconds = time.perf_counter() - t0
    del generator
    gc.collect()
    return seconds, [r.sequences_ids[0] for r in results]

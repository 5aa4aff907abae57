"""Embeddings (`--is-embedding`): OpenAI's /v1/embeddings and SGLang's /encode.

An embedding request is a prefill-only generation (max_new_tokens 0) that asks for hidden
states: it shares the batch and the radix cache with everything else and decodes nothing. The
rows come back through the hidden-state path (the final norm's output, as a sentence-transformers
or HF `AutoModel` reads it) and are pooled here: the last token's row, or the mean of every
prompt row, L2-normalized where the model says (sentence-transformers' modules.json: Pooling and
Normalize; without it, last token and normalized, as SGLang's default for decoder embedders).
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.runtime.value_checks import ValidationError, check_fields, is_int, type_name

EMBEDDINGS_FIELDS = ("model", "input", "encoding_format", "dimensions", "user")
ENCODE_FIELDS = ("text", "input_ids", "rid")


@dataclass(frozen=True)
class Pooling:
    mode: str = "last"  # "last" | "mean" | "cls"
    normalize: bool = True

    @staticmethod
    def of_model(model_path: str | None) -> "Pooling":
        """From a sentence-transformers layout in the model folder, else the default."""
        folder = Path(model_path) if model_path else None
        modules_file = folder / "modules.json" if folder is not None and folder.is_dir() else None
        if modules_file is None or not modules_file.is_file():
            return Pooling()
        modules = json.loads(modules_file.read_text())
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        if pooling is None:
            return Pooling(normalize=normalize)
        cfg = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
        modes = [mode for key, mode in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                        ("pooling_mode_cls_token", "cls")) if cfg.get(key)]
        if len(modes) != 1:
            raise ValueError(f"{model_path}: pooling {cfg} is not one of last token, mean or CLS")
        return Pooling(modes[0], normalize)

    @property
    def needs_every_row(self) -> bool:
        return self.mode != "last"

    def pool(self, rows: list[list[float]], dimensions: int | None = None) -> np.ndarray:
        x = np.asarray(rows, dtype=np.float32)
        vector = {"last": lambda: x[-1], "cls": lambda: x[0], "mean": lambda: x.mean(axis=0)}[self.mode]()
        if dimensions is not None:  # Matryoshka: the leading dimensions, normalized again below
            vector = vector[:dimensions]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector


def _prompts(value: Any, field: str) -> tuple[list[dict[str, Any]], bool]:
    """OpenAI's input: a string, strings, ids, or lists of ids -> one prompt body each, and
    whether the input was a list of prompts."""
    if isinstance(value, str):
        return [{"text": value}], False
    if isinstance(value, list) and value and all(is_int(t) for t in value):
        return [{"input_ids": value}], False
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [{"text": v} for v in value], True
    if isinstance(value, list) and value and all(isinstance(v, list) and v and all(is_int(t) for t in v)
                                                 for v in value):
        return [{"input_ids": v} for v in value], True
    raise ValidationError(field, "must be a string, a list of strings, a list of token ids or a list of such lists, "
                                 f"none empty; got {type_name(value)}")


def _generate_body(prompts: list[dict[str, Any]], pooling: Pooling) -> dict[str, Any]:
    key = "text" if "text" in prompts[0] else "input_ids"
    return {key: [p[key] for p in prompts], "sampling_params": {"max_new_tokens": 0},
            "return_hidden_states": True, "logprob_start_len": 0 if pooling.needs_every_row else -1}


async def embeddings(tm: Any, body: Any, pooling: Pooling, model: str) -> dict[str, Any]:
    """OpenAI's /v1/embeddings."""
    check_fields(body, EMBEDDINGS_FIELDS, "/v1/embeddings")
    prompts, _ = _prompts(body.get("input"), "input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ValidationError("encoding_format", f"must be \"float\" or \"base64\", got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not is_int(dimensions) or dimensions < 1):
        raise ValidationError("dimensions", f"must be a positive integer, got {dimensions!r}")
    results = await tm.generate(_generate_body(prompts, pooling), embedding=True)
    width = len(results[0]["meta_info"]["hidden_states"][0])
    if dimensions is not None and dimensions > width:
        raise ValidationError("dimensions", f"must be at most the model's width ({width}), got {dimensions}")
    data = []
    for i, out in enumerate(results):
        vector = pooling.pool(out["meta_info"]["hidden_states"], dimensions)
        data.append({"object": "embedding", "index": i,
                     "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode()
                     if encoding == "base64" else vector.tolist()})
    tokens = sum(out["meta_info"]["prompt_tokens"] for out in results)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def encode(tm: Any, body: Any, pooling: Pooling) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang's /encode: {"text"} or {"input_ids"}, one or a batch -> {"embedding", "meta_info"}."""
    check_fields(body, ENCODE_FIELDS, "/encode")
    if ("text" in body) == ("input_ids" in body):
        raise ValidationError("text", "or input_ids: give exactly one")
    field = "text" if "text" in body else "input_ids"
    prompts, is_batch = _prompts(body[field], field)
    gen = _generate_body(prompts, pooling)
    if "rid" in body:
        gen["rid"] = body["rid"]
    results = await tm.generate(gen, embedding=True)
    outs = [{"embedding": pooling.pool(out["meta_info"]["hidden_states"]).tolist(),
             "meta_info": {k: out["meta_info"][k] for k in ("id", "prompt_tokens", "cached_tokens", "e2e_latency")
                           if k in out["meta_info"]}} for out in results]
    return outs if is_batch else outs[0]


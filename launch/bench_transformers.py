"""transformers `generate` as a peer in `bench offline`: the same checkpoint (a GGUF through
`gguf_file=`), greedy, static left-padded batches, each decoded to its longest output length with
min_new_tokens = max_new_tokens, so EOS cannot end a row early (ignore_eos on the tandem side).
"""
from __future__ import annotations

import gc
import os
import time

import torch


def load_hf_model(model_path: str | None, dtype: str):
    from transformers import AutoModelForCausalLM

    from tandem.runtime.model_files import resolve_model_path

    path = resolve_model_path(model_path)
    torch_dtype = getattr(torch, dtype)
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch_dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def _generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    ids, mask = left_pad(prompts, pad_id)
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)


def run(model_path: str | None, dtype: str, batches: list[tuple[list[list[int]], list[int]]]) -> tuple[float, int]:
    """Seconds for every (prompts, output lengths) batch after a warm-up, and the tokens decoded
    (padding included: each batch runs to its longest output)."""
    model = load_hf_model(model_path, dtype)
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    pad_id = pad_id[0] if isinstance(pad_id, list) else int(pad_id)
    computed = 0
    with torch.inference_mode():
        _generate(model, batches[0][0][:2], 4, pad_id)  # warm-up
        t0 = time.perf_counter()
        for prompts, out_lens in batches:
            out = _generate(model, prompts, max(out_lens), pad_id)
            if out.shape[1] - max(len(p) for p in prompts) != max(out_lens):
                raise RuntimeError("transformers stopped before max_new_tokens")
            computed += len(prompts) * max(out_lens)
        seconds = time.perf_counter() - t0
    del model
    gc.collect()
    return seconds, computed


class _TokenClock:
    """A generate() streamer that only notes when each put (the prompt, then each new token) arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def one_batch(model, prompts: list[list[int]], output_len: int, repeats: int = 2) -> dict:
    """`bench one-batch`'s figures for transformers on one static batch (left-padded), from one
    generate() of output_len tokens, timed token by token: prefill latency until the first new
    token, decode latency per step after it. The best of `repeats` runs, after a warm-up."""
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    pad_id = pad_id[0] if isinstance(pad_id, list) else int(pad_id)
    ids, mask = left_pad(prompts, pad_id)
    best: tuple[float, float] | None = None
    with torch.inference_mode():
        _generate(model, prompts[:1], 2, pad_id)  # warm-up
        for _ in range(repeats):
            clock = _TokenClock()
            t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                           min_new_tokens=output_len, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None,
                           streamer=clock)
            first, last = clock.times[-output_len], clock.times[-1]
            run = (first - t0, (last - first) / max(output_len - 1, 1))
            best = run if best is None or sum(run) < sum(best) else best
    prefill_s, step_s = best
    return {"prefill_latency_s": round(prefill_s, 4),
            "prefill_throughput_tok_s": round(sum(map(len, prompts)) / prefill_s, 1),
            "median_decode_latency_s": round(step_s, 5),
            "decode_throughput_tok_s": round(len(prompts) / step_s, 1) if step_s else 0.0}

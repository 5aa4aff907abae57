"""transformers `generate` as a peer in `bench offline`: the same checkpoint (a GGUF through
`gguf_file=`), greedy, static left-padded batches, each decoded to its longest output length with
min_new_tokens = max_new_tokens, so EOS cannot end a row early (ignore_eos on the tandem side).

transformers runs on tandem's device in tandem's dtype, so the two compare like with like (here
and in `bench one-batch --transformers`): by default where tandem's `--device auto` resolves
(ServerArgs.resolved_device: CUDA when there is one, else CPU), or on a device the caller names.
On a CPU-only machine it runs on CPU, as it always has.
"""
from __future__ import annotations

import gc
import os
import time

import torch


def pick_device(device: str = "auto", cuda_available: bool | None = None) -> str:
    """Where transformers runs: `device` as tandem's --device takes it; "auto" resolves as tandem's
    does (ServerArgs.resolved_device), to "cuda" when CUDA is available (`cuda_available`, default
    torch's answer), else "cpu"."""
    if device != "auto":
        return device
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    return "cuda" if cuda_available else "cpu"


def load_hf_model(model_path: str | None, dtype: str, device: str = "auto"):
    """The checkpoint in transformers, in `dtype`, on pick_device(device)."""
    from transformers import AutoModelForCausalLM

    from tandem.runtime.model_files import resolve_model_path

    path = resolve_model_path(model_path)
    torch_dtype = getattr(torch, dtype)
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(pick_device(device)).eval()


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read after it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def _generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    ids, mask = (t.to(model.device) for t in left_pad(prompts, pad_id))
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)


def run(model_path: str | None, dtype: str, batches: list[tuple[list[list[int]], list[int]]],
        device: str = "auto") -> tuple[float, int]:
    """Seconds for every (prompts, output lengths) batch after a warm-up, and the tokens decoded
    (padding included: each batch runs to its longest output). On pick_device(device)."""
    model = load_hf_model(model_path, dtype, device)
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    pad_id = pad_id[0] if isinstance(pad_id, list) else int(pad_id)
    computed = 0
    with torch.inference_mode():
        _generate(model, batches[0][0][:2], 4, pad_id)  # warm-up
        _sync(model.device)
        t0 = time.perf_counter()
        for prompts, out_lens in batches:
            out = _generate(model, prompts, max(out_lens), pad_id)
            if out.shape[1] - max(len(p) for p in prompts) != max(out_lens):
                raise RuntimeError("transformers stopped before max_new_tokens")
            computed += len(prompts) * max(out_lens)
        _sync(model.device)
        seconds = time.perf_counter() - t0
    on_cuda = model.device.type == "cuda"
    del model
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()  # the memory back for whatever runs next in this process
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
    token, decode latency per step after it. The best of `repeats` runs, after a warm-up. On the
    model's device (load_hf_model's); generate hands the streamer each token copied to the host,
    so each put comes after its token is computed."""
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    pad_id = pad_id[0] if isinstance(pad_id, list) else int(pad_id)
    ids, mask = (t.to(model.device) for t in left_pad(prompts, pad_id))
    best: tuple[float, float] | None = None
    with torch.inference_mode():
        _generate(model, prompts[:1], 2, pad_id)  # warm-up
        for _ in range(repeats):
            clock = _TokenClock()
            _sync(model.device)
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

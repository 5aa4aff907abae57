"""The weights side of `tandem bench one-batch --quantization ...` and `bench offline --quantization
...`: which file and --quantization a variant runs, how many weight bytes a batch-1 decode step
reads, the machine's streaming read bandwidth, the batch-1 bound they give (bytes per token /
bandwidth), and llama.cpp's rows on the same files.

Variants: `none` (the model dequantized to --dtype, the reference path), `gguf` (the GGUF file's
blocks as stored), `q4_0` / `q4_1` / `q8_0` (the file's weights converted to that block type by the
gguf package's quantizer, cached: launch/gguf_convert.py; the file itself where it is that type).
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VARIANTS = ("none", "gguf", "q4_0", "q4_1", "q8_0")
LARGE_BUFFER = 1 << 30  # bytes: past any last-level cache, the DRAM figure


def resolve(model_path: str | None, variant: str) -> tuple[str | None, str]:
    """(model path, --quantization) of a variant."""
    if variant not in VARIANTS:
        raise ValueError(f"--quantization {variant!r}: one of {', '.join(VARIANTS)}")
    if variant in ("none", "gguf"):
        return model_path, variant
    from tandem.launch.gguf_convert import converted
    from tandem.runtime.model_files import default_model_path, is_gguf

    path = model_path or default_model_path()
    if not is_gguf(path):
        raise ValueError(f"--quantization {variant}: converts a GGUF file's weights; {path} is not one")
    return (path if _all_of(path, variant) else converted(path, variant)), "gguf"


def _all_of(path: str, variant: str) -> bool:
    from gguf import GGUFReader

    kinds = {t.tensor_type.name.lower() for t in GGUFReader(path).tensors if len(t.shape) == 2}
    return kinds == {variant}


def decode_bytes_per_token(model: nn.Module) -> int:
    """Weight bytes one batch-1 decode step reads: every linear's and the LM head's, as held (the
    embedding contributes one row, nothing, unless it is the head)."""
    from tandem.runtime.model.quant.gguf_load import held_bytes

    linears = [m.weight for name, m in model.named_modules()
               if name.rpartition(".")[2] not in ("embed_tokens", "lm_head") and not name.endswith("norm")
               and m is not model and getattr(m, "weight", None) is not None]
    head = getattr(model, "_head_fp32", None)
    return held_bytes([*linears, head])


def stream_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second the C++ op reads a buffer of `nbytes` at (the best of `repeats` passes after
    one untimed), on this process's intra-op threads; 0.0 without the C++ ops."""
    from tandem.kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        return 0.0
    buf = torch.ones(max(nbytes, 1 << 20) // 256 * 256, dtype=torch.uint8)
    ops.stream_read(buf)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ops.stream_read(buf)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() / best


def bound_fields(model: nn.Module) -> dict:
    """The batch-1 bandwidth bound of `model`: bytes per token over the read bandwidth of a buffer
    of the same size (the weights' case: cached where they fit in the last-level cache) and of 1 GiB."""
    per_token = decode_bytes_per_token(model)
    same, large = stream_bandwidth(per_token), stream_bandwidth(LARGE_BUFFER)
    return {"decode_bytes_per_token": per_token, "stream_gb_s_weights_size": round(same / 1e9, 2),
            "stream_gb_s_1gib": round(large / 1e9, 2),
            "bandwidth_bound_tok_s": round(same / per_token, 1) if per_token else None,
            "bandwidth_bound_dram_tok_s": round(large / per_token, 1) if per_token else None}


def resident_weight_bytes(model_path: str | None, quantization: str, dtype: str) -> int:
    """What the weights hold resident in a model process, measured: in a fresh interpreter, the RSS
    a ModelRunner adds (its load's transient copies given back, as the runner does) less its KV pool,
    over the same process with the C++ ops and the libraries already loaded."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from tandem.launch.bench_quant import _resident_here; "
            "print(json.dumps(_resident_here(*json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps([model_path, quantization, dtype])],
                          capture_output=True, text=True, check=True, timeout=600)
    return int(done.stdout.strip().splitlines()[-1])


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _resident_here(model_path: str | None, quantization: str, dtype: str) -> int:
    from tandem.kernels.cpu_ops import load_cpu_ops
    from tandem.runtime.host_malloc import release_freed_heap
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.server_args import ServerArgs

    load_cpu_ops()
    args = ServerArgs(model_path=model_path, quantization=quantization, dtype=dtype, max_total_tokens=256,
                      max_running_requests=1)
    ModelRunner(args)  # the first load pulls in the libraries and builds what is cached per process
    gc.collect()
    release_freed_heap()
    before = _rss()
    runner = ModelRunner(args)
    gc.collect()
    release_freed_heap()
    pool = sum(b.numel() * b.element_size() for b in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer)
    return _rss() - before - pool


SUMMARY_HEADER = (f"{'weights':<22} {'MB':>7} {'batch':>6} {'prefill tok/s':>14} {'decode tok/s':>13} "
                  f"{'x first':>8} {'B/token MB':>11} {'bound tok/s':>12} {'of bound':>9}")


def llamacpp_rows(rows: list[dict], input_len: int, output_len: int) -> list[dict]:
    """llama.cpp's llama-batched-bench on each GGUF file the variants ran (launch/bench_llamacpp.py),
    at the same batch sizes, lengths and thread count: [] where it is not built."""
    from tandem.launch import bench_llamacpp

    if bench_llamacpp.binary() is None:
        return []
    peers: list[dict] = []
    for path in dict.fromkeys(r["model_path"] for r in rows if r["weights"] != "none"):
        sizes = sorted({r["batch_size"] for r in rows if r["model_path"] == path})
        kinds = next(r["weights"] for r in rows if r["model_path"] == path and r["weights"] != "none")
        for peer in bench_llamacpp.run(path, sizes, input_len, output_len, torch.get_num_threads()):
            peers.append(peer | {"variant": "llama.cpp", "weights": kinds, "model_path": path,
                                 "weight_bytes": os.path.getsize(path)})
    return peers


def resident_lines(rows: list[dict], dtype: str) -> list[str]:
    """Each variant's resident weight memory, measured (resident_weight_bytes), against its file's
    size; the rows of that variant get the figures too."""
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "llama.cpp"):
        mine = [r for r in rows if r["variant"] == variant]
        path, quantization = resolve(mine[0]["model_path"], variant)
        resident = resident_weight_bytes(path, quantization, dtype)
        size = os.path.getsize(mine[0]["model_path"])
        for r in mine:
            r.update(resident_weight_bytes=resident, file_bytes=size)
        lines.append(f"resident weights, {variant}: {resident / 1e6:.1f} MB measured = {resident / size:.2f}x "
                     f"the file ({size / 1e6:.1f} MB); held {mine[0]['weight_bytes'] / 1e6:.1f} MB")
    return lines


def peer_ratio_lines(rows: list[dict]) -> list[str]:
    """tandem's decode and prefill over llama.cpp's on the same file and batch."""
    peers = {(r["model_path"], r["batch_size"]): r for r in rows if r["variant"] == "llama.cpp"}
    lines = []
    for r in rows:
        peer = peers.get((r.get("model_path"), r["batch_size"])) if r["variant"] != "llama.cpp" else None
        if peer and peer["decode_throughput_tok_s"] and peer["prefill_throughput_tok_s"]:
            lines.append(f"tandem {r['variant']} / llama.cpp on {os.path.basename(r['model_path'])}, batch "
                         f"{r['batch_size']}: decode {r['decode_throughput_tok_s'] / peer['decode_throughput_tok_s']:.2f}x, "
                         f"prefill {r['prefill_throughput_tok_s'] / peer['prefill_throughput_tok_s']:.2f}x")
    return lines


def summary_rows(rows: list[dict]) -> list[str]:
    """One line per (variant, batch): decode tok/s and its ratio to the first variant's at the same
    batch; at batch 1 the bandwidth bound (weights-size buffer) and the share of it reached."""
    first = {r["batch_size"]: r["decode_throughput_tok_s"] for r in rows if r["variant"] == rows[0]["variant"]}
    lines = []
    for r in rows:
        ratio = r["decode_throughput_tok_s"] / first[r["batch_size"]] if first.get(r["batch_size"]) else 0.0
        bound = r.get("bandwidth_bound_tok_s")
        of = format(r["decode_throughput_tok_s"] / bound, ".0%") if bound else "-"
        per_token = f"{r['decode_bytes_per_token'] / 1e6:.1f}" if "decode_bytes_per_token" in r else "-"
        lines.append(f"{r['variant'] + ' ' + r['weights']:<22.22} {r['weight_bytes'] / 1e6:>7.1f} {r['batch_size']:>6} "
                     f"{r['prefill_throughput_tok_s']:>14.1f} {r['decode_throughput_tok_s']:>13.1f} {ratio:>7.2f}x "
                     f"{per_token:>11} {bound if bound else '-':>12} {of:>9}")
    return lines


def offline(variants: list[str], model_path: str | None, prompts: list[list[int]], output_lens: list[int],
            engine_run: Callable[[str | None, str], Any]) -> list[dict]:
    """bench offline --quantization: `engine_run(path, quantization)` (a timed engine run of the
    workload: .seconds, .after = server_info) per variant, then llama.cpp on each GGUF file where it
    is built: every sequence at once, each at the workload's mean input and output length (it runs
    one length), output tok/s over its whole run, prefill included, as tandem's are. Rows printed
    as they come."""
    from tandem.launch.bench_progress import emit
    from tandem.runtime.model_files import default_model_path

    output_tokens, rows = sum(output_lens), []
    for variant in variants:
        path, quantization = resolve(model_path, variant)
        run = engine_run(path, quantization)
        rows.append({"variant": variant, "weights": run.after["weight_quantization"],
                     "model_path": path or default_model_path(), "weight_bytes": run.after["weight_bytes"],
                     "seconds": run.seconds, "output_tok_s": output_tokens / run.seconds})
        emit(_offline_line(rows[-1], rows[0]))
    mean_in, mean_out = round(statistics.mean(map(len, prompts))), round(statistics.mean(output_lens))
    for peer in llamacpp_rows([r | {"batch_size": len(prompts)} for r in rows], mean_in, mean_out):
        rows.append(peer | {"output_tok_s": peer["batch_size"] * peer["output_len"] / peer["seconds"]})
        emit(f"{_offline_line(rows[-1], rows[0])}  ({len(prompts)} seqs of {mean_in} in, {mean_out} out)")
    return rows


def _offline_line(row: dict, first: dict) -> str:
    return (f"{row['variant'] + ' ' + row['weights']:<26.26} {row['weight_bytes'] / 1e6:>8.1f} MB "
            f"{row['output_tok_s']:>10.1f} tok/s {row['output_tok_s'] / first['output_tok_s']:>6.2f}x first")

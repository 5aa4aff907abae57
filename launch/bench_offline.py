"""`tandem bench offline`: offline throughput of tandem against its own bare model loop and transformers.

The nano-vllm / mini-sglang method: N sequences with random token-id prompts, input and output
lengths drawn (separately) uniform in [min_len, max_len], greedy with ignore_eos so every
sequence produces exactly its output length; one warm-up; output tokens/s = the sum of output
lengths over the wall time of one `generate` call holding every sequence. All systems run the
same prompts, in one process run, with the same dtype:

1. tandem Engine, overlap schedule on (the default; "tandem" in the ratios),
2. tandem Engine, overlap schedule off,
3. the bare model loop (tandem's model, no scheduler/IPC/detokenizer): static batches of up to
   --max-running-requests, each decoded for the longest output in the batch,
4. transformers `generate`: static left-padded batches of --hf-batch-size (peer, on by default,
   launch/bench_transformers.py),
5. CTranslate2 float32 and int8 (`--peers ...,ctranslate2`, launch/bench_ctranslate2.py),
6. the GEMM-only bound: the model's matmuls alone for the same token counts on this CPU
   (launch/gemm_bound.py), so each system's distance from the machine's limit shows.

(3), (4) and (5) compute tokens past a shorter sequence's end (static batching pads them); only each
sequence's own output length counts as useful, so their tok/s is what a user gets, and the
waste shows in `*_useful_fraction`.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.launch.bench_progress import Progress, emit
from tandem.launch.bench_serving_ab import side_order
from tandem.runtime.server_args import KV_CACHE_DTYPES

FIRST_ORDINARY_ID = 17  # below this SmolLM2 keeps its special tokens; random prompts avoid them
KV_SLACK_TOKENS = 256


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class SystemResult:
    name: str
    output_tokens: int  # useful tokens: each sequence's own output length
    seconds: float
    computed_tokens: int = 0  # tokens actually decoded, padding included (static batching)
    idle_fraction: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int,
                  output_len: int | None = None) -> Workload:
    rng = random.Random(seed)
    in_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    out_lens = [rng.randint(min_len, max_len) for _ in range(num_seqs)]
    if output_len is not None:  # drawn anyway, so the prompts do not depend on it
        out_lens = [output_len] * num_seqs
    prompts = [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)] for n in in_lens]
    return Workload(prompts, out_lens)


def batches(wl: Workload, size: int) -> list[tuple[list[list[int]], list[int]]]:
    return [(wl.prompts[i:i + size], wl.output_lens[i:i + size]) for i in range(0, len(wl.prompts), size)]


def _greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


# ---------------------------------------------------------------- the systems


@dataclass
class TimedRun:
    seconds: float
    before: dict[str, Any]  # server_info just before the timed run
    after: dict[str, Any]  # and just after


def timed_engine_run(wl: Workload, model_path: str | None, **server_args: Any) -> TimedRun:
    """The workload, greedy, through an Engine: a warm-up, a cache flush (the timed run must not
    hit the warm-up's prefixes), then the timed run between two server_info reads."""
    from tandem.runtime.engine import Engine

    with Engine(model_path, log_level="warning", **server_args) as engine:
        engine.generate(input_ids=wl.prompts[:2], sampling_params=[_greedy(4)] * 2)
        engine.flush_cache()
        before = engine.server_info()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=wl.prompts, sampling_params=[_greedy(n) for n in wl.output_lens])
        seconds = time.perf_counter() - t0
        after = engine.server_info()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    if tokens != wl.output_tokens:
        raise RuntimeError(f"engine produced {tokens} output tokens, expected {wl.output_tokens}")
    return TimedRun(seconds, before, after)


def run_engine(args: argparse.Namespace, wl: Workload, overlap: bool) -> SystemResult:
    run = timed_engine_run(wl, args.model_path, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                           max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
                           disable_overlap_schedule=not overlap)
    info = run.after
    if info["overlap_schedule"] is not overlap:
        raise RuntimeError(f"asked for overlap {overlap}, the server ran {info['overlap_schedule']}")
    keep = {k: info.get(k) for k in ("step_time_median_ms", "step_time_p99_ms", "num_steps", "num_retractions")}
    name = "tandem (overlap on)" if overlap else "tandem (overlap off)"
    tokens = wl.output_tokens
    return SystemResult(name, tokens, run.seconds, tokens, idle_in_window(run.before, info), keep)


def run_guided(args: argparse.Namespace, wl: Workload, schema: str) -> tuple[SystemResult, SystemResult, Any]:
    """--json-schema: every sequence constrained by the schema, then the same prompts unconstrained
    with each sequence's output length matched to what the constrained run produced (a grammar
    ends sequences early; matching the lengths compares the same work). One engine, overlap on,
    the cache flushed before each timed run."""
    from tandem.runtime.engine import Engine

    with Engine(args.model_path, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
                log_level="warning") as engine:
        constrained = [{**_greedy(n), "json_schema": schema} for n in wl.output_lens]
        engine.generate(input_ids=wl.prompts[:2], sampling_params=constrained[:2])  # warm-up, compiles
        engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=wl.prompts, sampling_params=constrained)
        guided_s = time.perf_counter() - t0
        mask_us = engine.server_info().get("grammar_mask_us_per_row")
        lens = [o["meta_info"]["completion_tokens"] for o in outs]
        engine.flush_cache()
        t0 = time.perf_counter()
        plain = engine.generate(input_ids=wl.prompts, sampling_params=[_greedy(n) for n in lens])
        plain_s = time.perf_counter() - t0
    tokens = sum(lens)
    if sum(o["meta_info"]["completion_tokens"] for o in plain) != tokens:
        raise RuntimeError("the unconstrained run did not match the constrained output lengths")
    return (SystemResult("tandem json_schema", tokens, guided_s, tokens, info={"grammar_mask_us_per_row": mask_us}),
            SystemResult("tandem same lengths", tokens, plain_s, tokens), mask_us)


def idle_in_window(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Device idle share of the timed run alone, from the worker's cumulative busy/idle seconds.
    The server's device_idle_fraction is cumulative since start (warm-up included); it is the
    fallback when a server does not report the raw counters."""
    try:
        busy = after["device_busy_s"] - before["device_busy_s"]
        idle = after["device_idle_s"] - before["device_idle_s"]
    except KeyError:
        return after.get("device_idle_fraction")
    return round(idle / (busy + idle), 4) if busy + idle > 0 else 0.0


def run_bare(args: argparse.Namespace, wl: Workload) -> SystemResult:
    from tandem.launch.bare_loop import BareLoop
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.server_args import ServerArgs

    runner = ModelRunner(ServerArgs(model_path=args.model_path, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                    max_total_tokens=args.max_total_tokens,
                                    max_running_requests=args.max_running_requests))
    loop = BareLoop(runner)
    loop.generate(wl.prompts[:2], 4)  # warm-up
    computed = 0
    t0 = time.perf_counter()
    for prompts, out_lens in batches(wl, args.max_running_requests):
        loop.generate(prompts, max(out_lens))
        computed += len(prompts) * max(out_lens)
    seconds = time.perf_counter() - t0
    del loop, runner
    gc.collect()
    return SystemResult("bare model loop", wl.output_tokens, seconds, computed)


def run_transformers(args: argparse.Namespace, wl: Workload) -> SystemResult:
    from tandem.launch import bench_transformers

    seconds, computed = bench_transformers.run(args.model_path, args.dtype, batches(wl, args.hf_batch_size))
    return SystemResult("transformers generate", wl.output_tokens, seconds, computed)


def run_ctranslate2(args: argparse.Namespace, wl: Workload, compute_type: str) -> SystemResult:
    """All prompts to CTranslate2's own batching at once, decoded to the longest output length
    (one length per call: shorter sequences are padded work, counted as not useful)."""
    from tandem.launch import bench_ctranslate2
    from tandem.runtime.model_files import resolve_model_path

    longest = max(wl.output_lens)
    seconds, ids = bench_ctranslate2.run(resolve_model_path(args.model_path), wl.prompts, longest, compute_type,
                                              torch.get_num_threads())
    produced = sum(map(len, ids))
    if produced != longest * len(wl.prompts):
        raise RuntimeError(f"ctranslate2 produced {produced} tokens, expected {longest * len(wl.prompts)}")
    return SystemResult(f"ctranslate2 {compute_type}", wl.output_tokens, seconds, produced)


def gemm_bound(args: argparse.Namespace, wl: Workload) -> SystemResult:
    """The machine's limit for this workload: the model's matmuls alone (launch/gemm_bound.py)."""
    from tandem.launch import gemm_bound as gb
    from tandem.runtime.model.loader import load_config
    from tandem.runtime.model_files import resolve_model_path

    cfg = load_config(resolve_model_path(args.model_path))
    bound = gb.measure(cfg, getattr(torch, args.dtype), min(len(wl.prompts), args.max_running_requests))
    seconds = bound.seconds(sum(map(len, wl.prompts)), wl.output_tokens)
    return SystemResult("GEMM-only bound", wl.output_tokens, seconds, wl.output_tokens,
                        info={"decode_batch": bound.decode_batch, "decode_tok_s": round(bound.decode_tok_s, 1)})


# ---------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu_model": model, "cpu_cores": os.cpu_count() or 0, "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def build_report(args: argparse.Namespace, wl: Workload, res: dict[str, SystemResult],
                 overlap_pairs: list[float]) -> dict[str, Any]:
    """overlap_pairs: off seconds / on seconds of each alternating pair of engine runs."""
    on, off, bare, hf = (res.get(k) for k in ("overlap", "no_overlap", "bare", "transformers"))
    ct2, bound = res.get("ctranslate2_float32"), res.get("gemm_bound")
    guided, same = res.get("guided"), res.get("guided_baseline")
    report: dict[str, Any] = {
        "guided_over_unconstrained": _ratio(guided.tok_s, same.tok_s) if guided and same else None,
        "tandem_overlap_tok_s": round(on.tok_s, 2),
        "tandem_no_overlap_tok_s": round(off.tok_s, 2),
        "bare_tok_s": round(bare.tok_s, 2),
        "transformers_tok_s": round(hf.tok_s, 2) if hf else None,
        "tandem_over_transformers": _ratio(on.tok_s, hf.tok_s if hf else None),
        "tandem_over_bare": _ratio(on.tok_s, bare.tok_s),
        "ctranslate2_float32_tok_s": round(ct2.tok_s, 2) if ct2 else None,
        "ctranslate2_int8_tok_s": round(res["ctranslate2_int8"].tok_s, 2) if "ctranslate2_int8" in res else None,
        "tandem_over_ctranslate2": _ratio(on.tok_s, ct2.tok_s if ct2 else None),
        "gemm_bound_tok_s": round(bound.tok_s, 2) if bound else None,
        "tandem_over_gemm_bound": _ratio(on.tok_s, bound.tok_s if bound else None),
        "overlap_speedup": _ratio(on.tok_s, off.tok_s),
        "overlap_speedup_paired_median": round(statistics.median(overlap_pairs), 4),
        "overlap_speedup_pairs": [round(r, 4) for r in overlap_pairs],
        "idle_fraction_overlap": on.idle_fraction,
        "idle_fraction_no_overlap": off.idle_fraction,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_seqs": len(wl.prompts),
        "min_len": args.min_len,
        "max_len": args.max_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "max_running_requests": args.max_running_requests,
        "hf_batch_size": args.hf_batch_size,
        "repeats": args.repeats,
        "total_input_tokens": sum(len(p) for p in wl.prompts),
        "total_output_tokens": wl.output_tokens,
        "model_path": args.model_path or "default (SmolLM2-135M-Instruct GGUF)",
    }
    for key, r in res.items():
        report[f"{key}_seconds"] = round(r.seconds, 4)
        report[f"{key}_useful_fraction"] = round(r.output_tokens / r.computed_tokens, 4) if r.computed_tokens else None
        report.update({f"{key}_{k}": v for k, v in r.info.items()})
    return {**report, **machine_info()}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


TABLE_HEADER = f"{'system':<24} {'tok/s':>10} {'seconds':>9} {'useful':>7} {'device idle':>12} {'of bound':>9}"


def table_row(r: SystemResult, bound: SystemResult | None) -> str:
    useful = r.output_tokens / r.computed_tokens if r.computed_tokens else None
    idle = None if r.idle_fraction is None else 100 * r.idle_fraction
    of_bound = r.tok_s / bound.tok_s if bound else None
    return (f"{r.name:<24} {r.tok_s:>10.1f} {r.seconds:>9.2f} {_fmt(useful, '.0%'):>7} "
            f"{_fmt(idle, '.1f') + ('%' if idle is not None else ''):>12} {_fmt(of_bound, '.0%'):>9}")


def table_summary(res: dict[str, SystemResult], report: dict[str, Any]) -> list[str]:
    """The lines under the rows: the bound's shape and the ratios, known once every system ran."""
    bound = res.get("gemm_bound")
    lines = [""]
    if bound:
        lines.append(f"(GEMM-only bound: the model's matmuls alone on this CPU, {report['dtype']}, decode at batch "
                     f"{bound.info['decode_batch']}: {bound.info['decode_tok_s']} tok/s)")
    lines.append(f"tandem / transformers   {_times(report['tandem_over_transformers'])}")
    if report["tandem_over_ctranslate2"] is not None:
        lines.append(f"tandem / ctranslate2    {_times(report['tandem_over_ctranslate2'])}   (ctranslate2 float32, tandem {report['dtype']})")
    lines.append(f"tandem / bare           {_fmt(report['tandem_over_bare'], '.2f')}   (serving efficiency)")
    pairs = report["overlap_speedup_pairs"]
    lines.append(f"overlap on / off        {_times(report['overlap_speedup'])}   (best of each; paired runs: median "
                 f"{_times(report['overlap_speedup_paired_median'])}, {min(pairs):.2f}-{max(pairs):.2f}x over {len(pairs)})")
    if report["guided_over_unconstrained"] is not None:
        lines.append(f"json_schema / unconstrained (same output lengths)   "
                     f"{_times(report['guided_over_unconstrained'])}   grammar mask "
                     f"{_fmt(report.get('guided_grammar_mask_us_per_row'), '.1f')} us per row per step")
    return lines


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench offline", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model-path", default=None, help="HF folder or .gguf; default the embedded SmolLM2-135M-Instruct")
    a("--num-seqs", type=int, default=64)
    a("--min-len", type=int, default=32, help="shortest input and output length")
    a("--max-len", type=int, default=256, help="longest input and output length")
    a("--seed", type=int, default=0)
    a("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
      help="auto: what `--dtype auto` picks on this CPU (bf16 only where it measures faster)")
    a("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
      help="tandem's KV pool (engine and bare loop); the peers keep their own")
    a("--output-len", type=int, default=None, help="every sequence's output length (default: drawn like inputs)")
    a("--max-running-requests", type=int, default=64, help="engine batch cap; also the bare loop's batch size")
    a("--max-total-tokens", type=int, default=None, help="KV slots; default fits every sequence at once")
    a("--hf-batch-size", type=int, default=16)
    a("--repeats", type=int, default=1, help="tandem overlap off/on runs, alternating; the best of each is reported")
    a("--peers", default="transformers", help="comma list of transformers, ctranslate2 (fp32 and int8); '' for none")
    a("--skip-transformers", action="store_true", help="drop transformers from --peers")
    a("--json-schema", default=None, help="also run every sequence under this JSON schema (a file) against "
                                          "the same prompts unconstrained, with matched output lengths")
    a("--speculative-algorithm", choices=["NGRAM"], default=None,
      help="instead: speculative over plain decoding on a repetitive workload (launch/bench_spec.py)")
    a("--speculative-num-draft-tokens", type=int, default=4)
    a("--spec-batch-sizes", type=int, nargs="+", default=[1, 16])
    a("--spec-waves", type=int, default=2, help="waves of batch-size requests per batch size")
    a("--spec-output-len", type=int, default=160, help="max_new_tokens of the speculative workload")
    a("--quantization", nargs="+", default=None, metavar="W",
      help="instead: the tandem engine (overlap on) on each weight format of a GGUF model in turn, one row "
           "each: none (dequantized to --dtype), gguf (the file as stored), q4_0 / q4_1 / q8_0 (converted); "
           "then llama.cpp on each file where it is built (python -m tandem.launch.bench_llamacpp build)")
    a("--output-file", default=None, help="write the result as JSON")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        raise SystemExit("need 1 <= --min-len <= --max-len")
    if min(args.num_seqs, args.max_running_requests, args.hf_batch_size, args.repeats) < 1:
        raise SystemExit("--num-seqs, --max-running-requests, --hf-batch-size and --repeats must be >= 1")
    if args.output_len is not None and args.output_len < 1:
        raise SystemExit("--output-len must be >= 1")
    if args.max_total_tokens is None:
        args.max_total_tokens = args.num_seqs * (args.max_len + max(args.max_len, args.output_len or 0)) + KV_SLACK_TOKENS
    args.peers = [p for p in args.peers.split(",") if p and not (p == "transformers" and args.skip_transformers)]
    unknown = set(args.peers) - {"transformers", "ctranslate2"}
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(sorted(unknown))}; choose transformers, ctranslate2")
    return args


def resolve_dtype(args: argparse.Namespace) -> None:
    """--dtype auto: the dtype the runner would pick on this CPU, so every system runs the same one."""
    if args.dtype != "auto":
        return
    from tandem.runtime.model.runner import pick_cpu_dtype
    from tandem.runtime.model.loader import load_config
    from tandem.runtime.model_files import resolve_model_path

    dtype, why = pick_cpu_dtype(load_config(resolve_model_path(args.model_path)))
    args.dtype = str(dtype).removeprefix("torch.")
    print(f"--dtype auto: {args.dtype} ({why})", flush=True)


def model_vocab(model_path: str | None) -> int:
    from tandem.runtime.model.loader import load_config
    from tandem.runtime.model_files import resolve_model_path

    return load_config(resolve_model_path(model_path)).vocab_size


def _measure_all(args: argparse.Namespace, wl: Workload,
                 progress: Progress) -> tuple[dict[str, SystemResult], list[float]]:
    """Every system in turn, each row printed as soon as it is final. The GEMM bound goes first so
    every row can say how close to it it came."""
    res: dict[str, SystemResult] = {}
    emit(TABLE_HEADER)

    def measured(key: str, what: str, run: Callable[[], SystemResult]) -> SystemResult:
        with progress.step(what):
            res[key] = run()
        emit(table_row(res[key], res.get("gemm_bound")))
        return res[key]

    measured("gemm_bound", "GEMM bound", lambda: gemm_bound(args, wl))
    # alternating off/on, the best of --repeats each: on 2 shared cores one run varies by ~5-10%,
    # as much as the difference overlap makes; each on/off pair also gives a ratio of two runs
    # minutes apart at most, and their median is the overlap figure least moved by that drift.
    # Pairs take turns at going first (off-on, on-off, ...) so a machine that slows or speeds up
    # over the bench does not always favour the same side. Their rows (the best of each) follow.
    best: dict[str, SystemResult] = {}
    overlap_pairs = []
    for i in range(args.repeats):
        pair = {}
        for key in side_order(["no_overlap", "overlap"], i):
            with progress.step(f"tandem {key.replace('_', ' ')} ({i + 1}/{args.repeats})"):
                pair[key] = run_engine(args, wl, overlap=key == "overlap")
        overlap_pairs.append(pair["no_overlap"].seconds / pair["overlap"].seconds)
        for key, run in pair.items():
            if key not in best or run.seconds < best[key].seconds:
                best[key] = run
    for key in ("overlap", "no_overlap"):
        res[key] = best[key]
        emit(table_row(best[key], res["gemm_bound"]))
    measured("bare", "bare loop", lambda: run_bare(args, wl))
    if "transformers" in args.peers:
        measured("transformers", "transformers", lambda: run_transformers(args, wl))
    if "ctranslate2" in args.peers:
        for compute_type in ("float32", "int8"):  # fp32 beside tandem's fp32; int8 for reference
            measured(f"ctranslate2_{compute_type}", f"ctranslate2 {compute_type}",
                     lambda: run_ctranslate2(args, wl, compute_type))
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f, progress.step("json_schema"):
            res["guided"], res["guided_baseline"], _ = run_guided(args, wl, f.read())
        for key in ("guided", "guided_baseline"):
            emit(table_row(res[key], res["gemm_bound"]))
    return res, overlap_pairs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.speculative_algorithm:
        from tandem.launch import bench_spec

        report = bench_spec.run(args)
        print(bench_spec.format_table(report), flush=True)
        if args.output_file:
            with open(args.output_file, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
        return 0
    resolve_dtype(args)
    if args.quantization:
        return _weight_formats(args)
    wl = make_workload(args.num_seqs, args.min_len, args.max_len, model_vocab(args.model_path), args.seed,
                       args.output_len)
    print(f"#seqs: {len(wl.prompts)}  #input tokens: {sum(map(len, wl.prompts))}  "
          f"#output tokens: {wl.output_tokens}  dtype: {args.dtype}  KV cache: {args.kv_cache_dtype}", flush=True)
    runs = (2 * args.repeats + 1 + ("transformers" in args.peers) + 2 * ("ctranslate2" in args.peers) + 1
            + bool(args.json_schema))
    with Progress(runs, "bench offline") as progress:
        res, overlap_pairs = _measure_all(args, wl, progress)
    report = build_report(args, wl, res, overlap_pairs)
    for line in table_summary(res, report):
        emit(line)
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def _weight_formats(args: argparse.Namespace) -> int:
    """--quantization: the weight formats on one workload (launch/bench_quant.py's offline)."""
    from tandem.launch import bench_quant

    wl = make_workload(args.num_seqs, args.min_len, args.max_len, model_vocab(args.model_path), args.seed,
                       args.output_len)
    print(f"#seqs: {len(wl.prompts)}  #output tokens: {wl.output_tokens}  dtype: {args.dtype}", flush=True)

    def engine_run(path: str | None, quantization: str) -> TimedRun:
        return timed_engine_run(wl, path, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantization=quantization,
                                max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests)
    rows = bench_quant.offline(args.quantization, args.model_path, wl.prompts, wl.output_lens, engine_run)
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump({"dtype": args.dtype, "num_seqs": args.num_seqs, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

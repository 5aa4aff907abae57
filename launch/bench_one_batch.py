"""`tandem bench one-batch`: prefill and decode latency of one static batch, no server (like SGLang's bench_one_batch);
with --transformers, transformers' generate on the same batches beside it; with --quantization none gguf q8_0 ...,
each weight format of a GGUF model in turn, a summary table across them and each one's batch-1 bandwidth bound
(launch/bench_quant.py), and llama.cpp on the same files where it is built (launch/bench_llamacpp.py)."""
from __future__ import annotations

import argparse
import gc
import json
import random

from tandem.launch.bench_offline import machine_info
from tandem.launch.bench_progress import Progress, emit
from tandem.launch import bench_quant, gemm_bound
from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import KV_CACHE_DTYPES, ServerArgs


def make_prompts(vocab: int, batch_size: int, input_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(17, vocab) for _ in range(input_len)] for _ in range(batch_size)]


def run(runner: ModelRunner, batch_size: int, input_len: int, output_len: int, seed: int = 0) -> dict:
    prompts = make_prompts(runner.config.vocab_size, batch_size, input_len, seed)
    res = BareLoop(runner).generate(prompts, output_len)
    decode_steps = max(output_len - 1, 1)
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "prefill_latency_s": round(res.prefill_s, 4),
        "prefill_throughput_tok_s": round(batch_size * input_len / res.prefill_s, 1),
        "median_decode_latency_s": round(res.decode_s / decode_steps, 5),
        "decode_throughput_tok_s": round(batch_size * decode_steps / res.decode_s, 1) if res.decode_s else 0.0,
        "total_latency_s": round(res.prefill_s + res.decode_s, 4),
    }


TABLE_HEADER = (f"{'batch':>6} {'in':>5} {'out':>5} {'prefill s':>10} {'prefill tok/s':>14} {'decode s/step':>14} "
                f"{'decode tok/s':>13} {'GEMM bound':>11} {'of bound':>9}")


def table_row(r: dict) -> str:
    of_bound = format(r["decode_of_gemm_bound"], ".0%") if "decode_of_gemm_bound" in r else "-"
    return (f"{r['batch_size']:>6} {r['input_len']:>5} {r['output_len']:>5} {r['prefill_latency_s']:>10.4f} "
            f"{r['prefill_throughput_tok_s']:>14.1f} {r['median_decode_latency_s']:>14.5f} "
            f"{r['decode_throughput_tok_s']:>13.1f} {r.get('gemm_bound_decode_tok_s', '-'):>11} {of_bound:>9}")


def transformers_row(r: dict) -> str:
    t = r["transformers"]
    return (f"{'hf ' + str(r['batch_size']):>6} {r['input_len']:>5} {r['output_len']:>5} "
            f"{t['prefill_latency_s']:>10.4f} {t['prefill_throughput_tok_s']:>14.1f} "
            f"{t['median_decode_latency_s']:>14.5f} {t['decode_throughput_tok_s']:>13.1f}   "
            f"tandem / transformers at batch {r['batch_size']}: prefill {r['prefill_over_transformers']}x, "
            f"decode {r['decode_over_transformers']}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench one-batch", description=__doc__)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="auto: the model dtype")
    parser.add_argument("--quantization", nargs="+", default=None, choices=bench_quant.VARIANTS, metavar="W",
                        help="the weights to run, one after another, in one table: none (dequantized to --dtype), "
                             "gguf (the GGUF file as stored), q4_0 / q4_1 / q8_0 (its weights converted to that "
                             "block type, cached); with each the batch-1 bandwidth bound. Unset: the server's default")
    parser.add_argument("--resident", action="store_true",
                        help="with --quantization: also measure each format's resident weight memory (RSS a model "
                             "process adds, less its KV pool) in a fresh interpreter")
    parser.add_argument("--output-file", default=None, help="append one JSON line per batch size")
    parser.add_argument("--transformers", action="store_true",
                        help="also time transformers' generate on the same batches (same checkpoint and dtype)")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    for i, variant in enumerate(args.quantization or [None]):
        rows += _run_variant(args, variant, transformers=args.transformers and i == 0)
        gc.collect()
    if args.quantization:
        rows += bench_quant.llamacpp_rows(rows, args.input_len, args.output_len)
        emit()
        emit(bench_quant.SUMMARY_HEADER)
        for line in bench_quant.summary_rows(rows) + bench_quant.peer_ratio_lines(rows):
            emit(line)
        if args.resident:
            for line in bench_quant.resident_lines(rows, args.dtype):
                emit(line)
        emit("bound: decode bytes per token (the linears' and the LM head's weights as held) over the read "
             "bandwidth of a buffer of that size (cached where it fits; the 1 GiB figure is in the JSON)")
    if args.output_file:
        with open(args.output_file, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def _run_variant(args: argparse.Namespace, variant: str | None, transformers: bool) -> list[dict]:
    model_path, quantization = (args.model_path, None) if variant is None else bench_quant.resolve(args.model_path,
                                                                                                   variant)
    need = max(args.batch_size) * (args.input_len + args.output_len) + 64
    runner = ModelRunner(ServerArgs(model_path=model_path, dtype=args.dtype, max_total_tokens=need,
                                    max_running_requests=max(args.batch_size), attention_backend=args.attention_backend,
                                    kv_cache_dtype=args.kv_cache_dtype, quantization=quantization))
    weights = runner.weight_info()
    run(runner, 1, min(args.input_len, 16), 2)  # warm-up
    print(f"model: {runner.model_path}  dtype: {runner.dtype}  KV: {runner.kv_dtype}  device: {runner.device}  "
          f"cpu: {machine_info()['cpu_model']}" + (f"  weights: {weights['weight_quantization']} "
                                                   f"({weights['weight_bytes'] / 1e6:.1f} MB)" if variant else ""),
          flush=True)
    emit(TABLE_HEADER)
    rows: list[dict] = []
    # the GEMM bound times dense MLPs of the run's dtype: a mixture of experts' is another shape, and
    # quantized weights are other kernels (no bound printed; --quantization prints the bandwidth bound)
    bound = runner.device.type == "cpu" and not runner.config.num_experts and weights["weight_quantization"] == "none"
    runs = len(args.batch_size) * (1 + transformers)
    extra = {"dtype": str(runner.dtype), "kv_cache_dtype": str(runner.kv_dtype)}
    if variant is not None:
        extra.update(variant=variant, weights=weights["weight_quantization"], weight_bytes=weights["weight_bytes"],
                     model_path=runner.model_path)
    with Progress(runs, "bench one-batch") as progress:
        for bs in args.batch_size:  # each row as soon as it is measured
            with progress.step(f"batch {bs}"):
                r = run(runner, bs, args.input_len, args.output_len)
                if bound:  # the machine's limit at this batch: the decode step's matmuls alone
                    r["gemm_bound_decode_tok_s"] = round(gemm_bound.measure(runner.config, runner.dtype, bs).decode_tok_s, 1)
                    r["decode_of_gemm_bound"] = round(r["decode_throughput_tok_s"] / r["gemm_bound_decode_tok_s"], 3)
                if variant is not None and bs == 1:
                    r.update(bench_quant.bound_fields(runner.model))
            rows.append(r)
            emit(table_row(r))
        if transformers:
            from tandem.launch import bench_transformers

            hf = bench_transformers.load_hf_model(args.model_path, str(runner.dtype).removeprefix("torch."))
            for r in rows:
                with progress.step(f"transformers batch {r['batch_size']}"):
                    prompts = make_prompts(runner.config.vocab_size, r["batch_size"], args.input_len)
                    r["transformers"] = bench_transformers.one_batch(hf, prompts, args.output_len)
                r["decode_over_transformers"] = round(r["decode_throughput_tok_s"] /
                                                      r["transformers"]["decode_throughput_tok_s"], 2)
                r["prefill_over_transformers"] = round(r["prefill_throughput_tok_s"] /
                                                       r["transformers"]["prefill_throughput_tok_s"], 2)
                emit(transformers_row(r))
            del hf
    del runner
    return [{**extra, **r} for r in rows]


if __name__ == "__main__":
    raise SystemExit(main())

"""`tandem bench moe`: a mixture-of-experts model's decode tok/s with the fused MoE op (the cpu
backend's C++ op, kernels/csrc/fused_moe_cpu.cpp) against the per-expert loop (the torch
reference, kernels/moe_reference.py: a Python loop over the experts any token chose), on the same
model and batches; and one MoE layer alone at each batch size.

Without --model-path it builds a tiny random Qwen3-MoE or Mixtral (launch/make_tiny_model.py) of
the sizes given, in a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import torch

from tandem.kernels.moe_reference import fused_moe_ref, route
from tandem.launch import bench_one_batch
from tandem.launch.bench_offline import machine_info
from tandem.runtime.model.moe import SparseMoE
from tandem.runtime.model.ops import TorchOps
from tandem.runtime.model.packed_linear import best_seconds
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs


def build_model(args: argparse.Namespace, folder: str) -> str:
    from tandem.launch.make_tiny_model import build_tiny_model

    experts = {"num_experts": args.experts} if args.arch == "qwen3_moe" else {"num_local_experts": args.experts}
    width = {"moe_intermediate_size": args.expert_width} if args.arch == "qwen3_moe" else \
        {"intermediate_size": args.expert_width}
    return str(build_tiny_model(folder, args.arch, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                kv_heads=args.kv_heads, num_experts_per_tok=args.top_k, **experts, **width))


def use_moe(runner: ModelRunner, fused: bool) -> None:
    """The MoE layers on the runner's ops (fused) or on the torch loop over experts."""
    ops = runner.model.norm.ops if fused else TorchOps()
    for module in runner.model.modules():
        if isinstance(module, SparseMoE):
            module.ops = ops


def layer_alone(runner: ModelRunner, batch: int, repeats: int) -> dict:
    """One MoE layer's experts (routing excluded) at `batch` tokens: fused op and loop, seconds."""
    moe = next(m for m in runner.model.modules() if isinstance(m, SparseMoE))
    w13, w2 = moe.experts.gate_up_proj, moe.experts.down_proj
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, w13.shape[2], generator=g).to(w13.dtype)
    weights, ids = route(torch.randn(batch, w13.shape[0], generator=g), moe.top_k, moe.renormalize)
    fused = runner.model.norm.ops
    if not hasattr(fused, "fused_moe") or isinstance(fused, TorchOps):
        return {}
    return {"layer_fused_s": best_seconds(lambda: fused.fused_moe(x, w13, w2, weights, ids), repeats),
            "layer_loop_s": best_seconds(lambda: fused_moe_ref(x, w13, w2, weights, ids), repeats)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench moe", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="a Qwen3-MoE or Mixtral folder; default: build a tiny one")
    p.add_argument("--arch", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=256, help="each expert's intermediate size")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto")
    p.add_argument("--repeats", type=int, default=2, help="runs per system and batch size; the best is reported")
    p.add_argument("--output-file", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = args.model_path or build_model(args, folder)
        need = max(args.batch_size) * (args.input_len + args.output_len) + 64
        runner = ModelRunner(ServerArgs(model_path=path, dtype=args.dtype, max_total_tokens=need,
                                        max_running_requests=max(args.batch_size), attention_backend="cpu"))
    if not runner.config.num_experts:
        raise SystemExit(f"{path}: not a mixture-of-experts model")
    bench_one_batch.run(runner, 1, min(args.input_len, 16), 2)  # warm-up
    rows = []
    for bs in args.batch_size:
        row = {"batch_size": bs}
        for name, fused in (("fused", True), ("loop", False)):
            use_moe(runner, fused)
            best = max((bench_one_batch.run(runner, bs, args.input_len, args.output_len) for _ in range(args.repeats)),
                       key=lambda r: r["decode_throughput_tok_s"])
            row[f"{name}_decode_tok_s"] = best["decode_throughput_tok_s"]
        use_moe(runner, True)
        row["fused_over_loop"] = round(row["fused_decode_tok_s"] / row["loop_decode_tok_s"], 2)
        row.update(layer_alone(runner, bs, repeats=20))
        rows.append(row)
    cfg = runner.config
    print(f"model: {path if args.model_path else 'tiny ' + args.arch}  {cfg.num_experts} experts, "
          f"top {cfg.num_experts_per_tok}, width {cfg.moe_intermediate_size}, hidden {cfg.hidden_size}, "
          f"{cfg.num_layers} layers  dtype: {runner.dtype}  cpu: {machine_info()['cpu_model']}  "
          f"ops: {runner.model.norm.ops.name}")
    print(f"{'batch':>6} {'fused tok/s':>12} {'loop tok/s':>11} {'fused/loop':>11} {'layer fused ms':>15} "
          f"{'layer loop ms':>14}")
    for r in rows:
        fused_ms = f"{r['layer_fused_s'] * 1e3:.3f}" if "layer_fused_s" in r else "-"
        loop_ms = f"{r['layer_loop_s'] * 1e3:.3f}" if "layer_loop_s" in r else "-"
        print(f"{r['batch_size']:>6} {r['fused_decode_tok_s']:>12.1f} {r['loop_decode_tok_s']:>11.1f} "
              f"{r['fused_over_loop']:>10.2f}x {fused_ms:>15} {loop_ms:>14}")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"dtype": str(runner.dtype), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

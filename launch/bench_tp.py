"""`tandem bench tp`: the same offline workload through the engine at each --tp-size, side by
side, with the time the model's collectives (all-reduce, logits all-gather) took per step.

On a CPU the ranks share the node's cores (each takes cores / ranks intra-op threads), so TP
there buys memory per rank, not speed: the table shows what the communication costs."""
from __future__ import annotations

import argparse
import json
from typing import Any

from tandem.launch.bench_offline import Workload, machine_info, make_workload, timed_engine_run
from tandem.launch.bench_progress import Progress, emit
from tandem.runtime.model.config import ModelConfig


def run_tp(args: argparse.Namespace, tp_size: int, wl: Workload) -> dict[str, Any]:
    run = timed_engine_run(wl, args.model_path, dtype=args.dtype, tp_size=tp_size,
                           max_total_tokens=args.max_total_tokens)
    before, after = run.before, run.after
    steps = after["num_steps"] - before["num_steps"]
    comm_s = after.get("tp_comm_s", 0.0) - before.get("tp_comm_s", 0.0)
    return {"tp_size": tp_size, "output_tokens": wl.output_tokens, "seconds": round(run.seconds, 3),
            "tok_s": round(wl.output_tokens / run.seconds, 2), "steps": steps,
            "comm_ms_per_step": round(1e3 * comm_s / steps, 3) if steps else 0.0,
            "comm_share": round(comm_s / run.seconds, 4)}


TABLE_HEADER = f"{'tp':>3} {'tok/s':>9} {'seconds':>9} {'steps':>6} {'comm ms/step':>13} {'comm share':>11} {'vs first':>9}"


def table_row(r: dict[str, Any], base_tok_s: float) -> str:
    return (f"{r['tp_size']:>3} {r['tok_s']:>9.1f} {r['seconds']:>9.2f} {r['steps']:>6} "
            f"{r['comm_ms_per_step']:>13.3f} {100 * r['comm_share']:>10.1f}% {r['tok_s'] / base_tok_s:>8.2f}x")


def check_tp_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelConfig:
    """The model's config, once every size is known to split it: a size that does not would fail
    only when its turn comes, after the earlier sizes ran, and lose their rows."""
    from tandem.runtime.model.loader import load_config
    from tandem.runtime.model.tensor_parallel import check_divisible
    from tandem.runtime.model_files import resolve_model_path

    cfg = load_config(resolve_model_path(args.model_path))
    for tp in args.tp_sizes:
        try:
            if tp < 1:
                raise ValueError("a size is at least 1")
            check_divisible(cfg, tp)
        except ValueError as exc:
            parser.error(f"--tp-sizes {tp}: {exc}")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench tp", description=__doc__)
    parser.add_argument("--model-path", default=None, help="default the embedded SmolLM2 (its heads split by 3 only)")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-total-tokens", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-file", default=None)
    args = parser.parse_args(argv)
    cfg = check_tp_sizes(parser, args)
    wl = make_workload(args.num_seqs, args.min_len, args.max_len, cfg.vocab_size, args.seed, args.output_len)
    print(f"#seqs: {args.num_seqs}  #output tokens: {wl.output_tokens}  dtype: {args.dtype}  {machine_info()}")
    rows: list[dict[str, Any]] = []
    emit(TABLE_HEADER)
    with Progress(len(args.tp_sizes), "bench tp") as progress:
        for tp in args.tp_sizes:  # each row as soon as its size ran
            with progress.step(f"tp {tp}"):
                rows.append(run_tp(args, tp, wl))
            emit(table_row(rows[-1], rows[0]["tok_s"]))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"machine": machine_info(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

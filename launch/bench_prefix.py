"""`tandem bench prefix`: what the radix cache buys on a shared-prefix workload, measured in one run.

G groups of P prompts; every prompt of a group is the group's random prefix followed by its own
random question (token ids, seeded, so both runs see the same prompts). The same Engine
configuration runs the workload twice, radix cache on and off. Each group's prompts are
submitted at once as one streaming batch (the scheduler sees them arrive together, as from
concurrent clients); groups follow one another, or all go at once with --burst.

TTFT = submission to the first streamed chunk that carries an output token. Throughput counts
prompt + output tokens over the wall time of all groups. Cache hit rate = cached prompt tokens
/ prompt tokens (from meta_info).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.launch.bench_offline import FIRST_ORDINARY_ID, machine_info, model_vocab
from tandem.launch.bench_progress import bar, emit
from tandem.runtime.frontend.request_groups import stream_error

if TYPE_CHECKING:
    from tqdm import tqdm

KV_SLACK_TOKENS = 1024


@dataclass
class ReqTiming:
    ttft_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class ModeResult:
    name: str
    timings: list[ReqTiming]
    seconds: float

    def ttfts_ms(self) -> list[float]:
        return [1000 * t.ttft_s for t in self.timings]

    @property
    def ttft_mean_ms(self) -> float:
        return statistics.fmean(self.ttfts_ms())

    @property
    def ttft_median_ms(self) -> float:
        return statistics.median(self.ttfts_ms())

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.timings)

    @property
    def output_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.timings)

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def cache_hit_rate(self) -> float:
        return sum(t.cached_tokens for t in self.timings) / max(self.prompt_tokens, 1)


def make_groups(num_groups: int, per_group: int, prefix_len: int, question_len: int, vocab: int,
                seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]

    groups = []
    for _ in range(num_groups):
        prefix = ids(prefix_len)
        groups.append([prefix + ids(question_len) for _ in range(per_group)])
    return groups


def run_wave(engine, prompts: list[list[int]], output_len: int) -> list[ReqTiming]:
    """Submit the prompts together as one streaming batch; time each one's first output token."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    first: dict[int, float] = {}
    last: dict[int, dict] = {}
    t0 = time.perf_counter()
    for chunk in engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts), stream=True):
        if (failed := stream_error(chunk)) is not None:
            raise RuntimeError(f"request failed: {failed.status_code}: {failed.message}")
        i = chunk.get("index", 0)
        if chunk["meta_info"]["completion_tokens"] > 0 and i not in first:
            first[i] = time.perf_counter() - t0
        last[i] = chunk["meta_info"]
    return [ReqTiming(first[i], last[i]["prompt_tokens"], last[i]["completion_tokens"], last[i]["cached_tokens"])
            for i in range(len(prompts))]


def run_mode(args: argparse.Namespace, groups: list[list[list[int]]], radix: bool,
             progress: tqdm | None = None) -> ModeResult:
    from tandem.runtime.engine import Engine

    waves = [[p for g in groups for p in g]] if args.burst else groups
    with Engine(args.model_path, dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                max_running_requests=max(len(w) for w in waves), disable_radix_cache=not radix,
                log_level="warning") as engine:
        run_wave(engine, [groups[0][0][:16]], 2)  # warm-up
        engine.flush_cache()
        timings: list[ReqTiming] = []
        t0 = time.perf_counter()
        for wave in waves:
            timings += run_wave(engine, wave, args.output_len)
            if progress is not None:
                progress.update(1)
        seconds = time.perf_counter() - t0
    return ModeResult("radix cache on" if radix else "radix cache off", timings, seconds)


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b > 0 else 0.0


def build_report(args: argparse.Namespace, on: ModeResult, off: ModeResult) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for key, r in (("cache_on", on), ("cache_off", off)):
        report.update({
            f"ttft_mean_ms_{key}": round(r.ttft_mean_ms, 3),
            f"ttft_median_ms_{key}": round(r.ttft_median_ms, 3),
            f"throughput_tok_s_{key}": round(r.total_tok_s, 2),
            f"output_tok_s_{key}": round(r.output_tok_s, 2),
            f"cache_hit_rate_{key}": round(r.cache_hit_rate, 4),
            f"duration_s_{key}": round(r.seconds, 4),
            f"completed_{key}": len(r.timings),
        })
    report.update({
        "ttft_speedup": _ratio(off.ttft_mean_ms, on.ttft_mean_ms),
        "ttft_median_speedup": _ratio(off.ttft_median_ms, on.ttft_median_ms),
        "throughput_ratio": _ratio(on.total_tok_s, off.total_tok_s),
        "num_groups": args.num_groups, "prompts_per_group": args.prompts_per_group,
        "prefix_len": args.prefix_len, "question_len": args.question_len, "output_len": args.output_len,
        "burst": args.burst, "dtype": args.dtype, "seed": args.seed,
        "model_path": args.model_path or "default (SmolLM2-135M-Instruct GGUF)",
    })
    return {**report, **machine_info()}


TABLE_HEADER = (f"{'mode':<18} {'TTFT mean ms':>13} {'TTFT median ms':>15} {'tok/s':>10} {'out tok/s':>10} "
                f"{'hit rate':>9} {'seconds':>8}")


def table_row(r: ModeResult) -> str:
    return (f"{r.name:<18} {r.ttft_mean_ms:>13.1f} {r.ttft_median_ms:>15.1f} {r.total_tok_s:>10.1f} "
            f"{r.output_tok_s:>10.1f} {r.cache_hit_rate:>9.1%} {r.seconds:>8.2f}")


def table_summary(report: dict[str, Any]) -> list[str]:
    return ["", f"TTFT speedup (off / on)       {report['ttft_speedup']:.2f}x mean, "
                f"{report['ttft_median_speedup']:.2f}x median",
            f"throughput ratio (on / off)   {report['throughput_ratio']:.2f}x"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench prefix", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--model-path", default=None, help="HF folder or .gguf; default the embedded SmolLM2-135M-Instruct")
    a("--num-groups", type=int, default=16)
    a("--prompts-per-group", type=int, default=8)
    a("--prefix-len", type=int, default=1024)
    a("--question-len", type=int, default=32)
    a("--output-len", type=int, default=16)
    a("--burst", action="store_true", help="submit every group at once instead of group after group")
    a("--seed", type=int, default=0)
    a("--dtype", choices=["float32", "bfloat16"], default="float32")
    a("--max-total-tokens", type=int, default=None, help="KV slots; default fits one wave uncached")
    a("--output-file", default=None, help="write the result as JSON")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if min(args.num_groups, args.prompts_per_group, args.prefix_len, args.question_len, args.output_len) < 1:
        raise SystemExit("group counts and lengths must be >= 1")
    if args.max_total_tokens is None:
        wave = args.prompts_per_group * (args.num_groups if args.burst else 1)
        args.max_total_tokens = wave * (args.prefix_len + args.question_len + args.output_len) + KV_SLACK_TOKENS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    groups = make_groups(args.num_groups, args.prompts_per_group, args.prefix_len, args.question_len,
                         model_vocab(args.model_path), args.seed)
    print(f"#groups: {args.num_groups} x {args.prompts_per_group} prompts, prefix {args.prefix_len} + question "
          f"{args.question_len} tokens, output {args.output_len}, {'burst' if args.burst else 'group by group'}",
          flush=True)
    emit(TABLE_HEADER)
    waves = 1 if args.burst else args.num_groups
    with bar(2 * waves, "bench prefix", unit="wave") as progress:  # each mode's row as soon as it ran
        modes = []
        for radix in (True, False):
            progress.set_postfix_str(f"radix cache {'on' if radix else 'off'}")
            modes.append(run_mode(args, groups, radix, progress))
            emit(table_row(modes[-1]))
    on, off = modes
    report = build_report(args, on, off)
    for line in table_summary(report):
        emit(line)
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

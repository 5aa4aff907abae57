"""`tandem bench serving`: online serving benchmark against a native `/generate` endpoint.

Speaks the same wire protocol as SGLang's `bench_serving --backend sglang`: streaming POST
/generate with cumulative SSE chunks ending in `data: [DONE]`. So it measures a tandem server
and an SGLang server the same way. Metric definitions live in `bench_metrics`, prompt sets in
`bench_datasets`. With `--launch` it starts a tandem server itself and always stops it.
Paired comparisons (through smg or not, overlap schedule on or off) live in `bench_serving_ab`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import json
import sys
from collections.abc import Iterator
from typing import Any

from tandem.launch.bench_chat import compare_tools
from tandem.launch.bench_client import report, run_benchmark
from tandem.launch.bench_datasets import DatasetRow, get_dataset, load_tokenizer
from tandem.launch.bench_serving_ab import Measure, check_comparison, compare_overlap, compare_via_gateway, flush_cache
from tandem.launch.managed_server import BenchError, start_server

@contextlib.contextmanager
def launched_server(args: Any) -> Iterator[str]:
    """--launch: a server with --server-args on a free port for the run; yields its base URL."""
    with start_server(args.server_args, args.server_module, args.launch_timeout) as (base_url, _):
        yield base_url


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench serving", description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--backend", default="sglang", choices=["sglang", "sglang-native"],
      help="wire protocol: SGLang's native /generate (the only one)")
    a("--base-url", default=None, help="server URL; default http://HOST:PORT")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--launch", action="store_true", help="start a tandem server on a free port for the run")
    a("--server-args", default="", help="one quoted string passed to the launched server")
    a("--server-module", default="tandem.launch.server", help="module run by --launch")
    a("--launch-timeout", type=float, default=300.0, help="seconds to wait for /health")
    a("--dataset-name", default="random",
      choices=["random", "generated-shared-prefix", "sharegpt", "jsonl"])
    a("--dataset-path", default="", help="local ShareGPT JSON or conversations JSONL")
    a("--tokenizer", default=None, help="send text built with this tokenizer, not input_ids")
    a("--vocab-size", type=int, default=49152, help="id range for random prompts")
    a("--num-prompts", type=int, default=1000)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=1024)
    a("--random-range-ratio", type=float, default=0.0)
    a("--gsp-num-groups", type=int, default=64)
    a("--gsp-prompts-per-group", type=int, default=16)
    a("--gsp-system-prompt-len", type=int, default=2048)
    a("--gsp-question-len", type=int, default=128)
    a("--gsp-output-len", type=int, default=256)
    a("--sharegpt-output-len", type=int, default=None, help="fixed output length")
    a("--sharegpt-context-len", type=int, default=None, help="skip longer prompt+output")
    a("--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf = burst")
    a("--max-concurrency", type=int, default=None)
    a("--warmup-requests", type=int, default=1)
    a("--seed", type=int, default=1)
    a("--disable-ignore-eos", action="store_true")
    a("--return-logprob", action="store_true")
    a("--extra-request-body", default=None, help="JSON object merged into every payload")
    a("--json-schema", default=None, help="constrain every request by this JSON schema (a file), then run the "
                                          "same prompts unconstrained with matched output lengths, and compare")
    a("--tools", default=None, help="OpenAI tools (a JSON file): stream every request through /v1/chat/completions "
                                    "without tools and with them (tool_choice auto, parsed by the server's "
                                    "--tool-call-parser), alternating, and compare inter-token latency")
    a("--tools-rounds", type=int, default=2, help="with --tools: without/with pairs to run")
    a("--flush-cache", action="store_true", help="POST /flush_cache after warmup")
    a("--via-gateway", action="store_true", help="put the SGLang Model Gateway (smg) in front of the server and "
                                                 "run the same workload straight and through it, alternating")
    a("--gateway-rounds", type=int, default=None, help="with --via-gateway: straight/gateway pairs to run (2)")
    a("--compare-overlap", action="store_true", help="with --launch: two servers from --server-args (both "
      "resident; give --max-total-tokens), overlap schedule on and off, the same rows through each in "
      "alternating rounds")
    a("--overlap-rounds", type=int, default=None, help="with --compare-overlap: on/off pairs to run (4)")
    a("--disable-tqdm", action="store_true")
    a("--output-file", default=None, help="write the result as JSON")
    a("--output-details", action="store_true", help="add per-request lists to the JSON")
    a("--plot", default=None, help="write latency CDFs and throughput over time (PNG)")
    return p


def _join_server_args(argv: list[str]) -> list[str]:
    """Let `--server-args "--flag"` through: argparse would read a lone "--flag" as an option."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--server-args" and i + 1 < len(argv):
            out.append(f"--server-args={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(_join_server_args(argv))
    args.extra_body = json.loads(args.extra_request_body) if args.extra_request_body else {}
    args.json_schema_text = None
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            args.json_schema_text = f.read()
    if args.num_prompts < 1 and args.dataset_name != "generated-shared-prefix":
        raise SystemExit("--num-prompts must be >= 1")
    check_comparison(args)
    return args


def _rows(args: argparse.Namespace) -> list[DatasetRow]:
    rows = get_dataset(args, load_tokenizer(args.tokenizer))
    if not rows:
        raise BenchError("the dataset produced no prompts")
    print(f"#Prompts: {len(rows)}  #Input tokens: {sum(r.prompt_len for r in rows)}  "
          f"#Output tokens: {sum(r.output_len for r in rows)}", flush=True)
    return rows


def _run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    rows = _rows(args)
    if args.json_schema_text:
        return _run_guided(args, rows, base_url)
    if args.tools:
        return compare_tools(args, rows, base_url)
    if args.via_gateway:
        return compare_via_gateway(args, base_url, functools.partial(_measure, args, rows))
    results, duration, t0 = asyncio.run(run_benchmark(args, rows, base_url))
    return report(args, results, duration, t0, server_accept_length(base_url))


def server_accept_length(base_url: str) -> float | None:
    """The server's running mean of tokens per speculative verify (None: it does not speculate)."""
    import requests

    try:
        return requests.get(base_url + "/server_info", timeout=30).json().get("avg_spec_accept_length")
    except (requests.RequestException, ValueError):
        return None


def _run_guided(args: argparse.Namespace, rows: list[DatasetRow], base_url: str) -> dict[str, Any]:
    """--json-schema: constrained, then unconstrained with each request's output length matched to
    what the grammar let it produce (the cache flushed before each run)."""
    each = copy.copy(args)
    each.output_file, each.plot, each.flush_cache = None, None, True
    print("\n== constrained by the JSON schema", flush=True)
    results, duration, t0 = asyncio.run(run_benchmark(each, rows, base_url))
    guided = report(each, results, duration, t0)
    matched = [DatasetRow(row.prompt, row.prompt_len, max(res.output_len, 1)) for row, res in zip(rows, results)]
    each.json_schema_text = None
    print("\n== unconstrained, same output lengths", flush=True)
    results, duration, t0 = asyncio.run(run_benchmark(each, matched, base_url))
    plain = report(each, results, duration, t0)
    ratio = guided["output_throughput"] / plain["output_throughput"] if plain["output_throughput"] else None
    print(f"\njson_schema / unconstrained output throughput: {ratio:.2f}x" if ratio else "", flush=True)
    combined = {"json_schema": guided, "unconstrained_same_lengths": plain, "guided_over_unconstrained": ratio}
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(combined, f, indent=2)
    return guided


def _measure(args: argparse.Namespace, rows: list[DatasetRow], url: str, server_url: str) -> Measure:
    """One round against `url`: `server_url`'s cache flushed first (the server's, also when `url`
    is a gateway in front of it), every row sent, the report printed and returned."""
    each = copy.copy(args)
    each.output_file, each.plot, each.flush_cache = None, None, False

    def once() -> dict[str, Any]:
        flush_cache(server_url)
        results, duration, t0 = asyncio.run(run_benchmark(each, rows, url))
        return report(each, results, duration, t0)
    return once


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0 when at least one request succeeded."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.compare_overlap:
            result = compare_overlap(args, functools.partial(_measure, args, _rows(args)))
        elif args.launch:
            with launched_server(args) as base_url:
                result = _run(args, base_url)
        else:
            base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
            result = _run(args, base_url)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

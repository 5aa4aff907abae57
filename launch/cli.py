"""The `tandem` command: serve, generate, bench ..."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module, what it measures)
_BENCHES = {
    "one-batch": ("tandem.launch.bench_one_batch", "prefill and decode latency of one static batch, no server"),
    "serving": ("tandem.launch.bench_serving", "online serving against a /generate endpoint"),
    "offline": ("tandem.launch.bench_offline", "offline throughput against the bare model loop and transformers"),
    "prefix": ("tandem.launch.bench_prefix", "what the radix cache buys on a shared-prefix workload"),
    "logprobs": ("tandem.launch.bench_logprobs", "the cost of prompt top logprobs, nested vs flat vs base64"),
    "kernels": ("tandem.launch.bench_kernels", "each Triton kernel against its torch reference"),
    "soak": ("tandem.launch.bench_soak", "minutes of hostile traffic, and an account of every request"),
    "fuzz": ("tandem.launch.bench_fuzz", "hypothesis-generated requests against every route"),
    "grammar-load": ("tandem.launch.bench_grammar_load", "what huge grammar compiles cost everyone else"),
    "tp": ("tandem.launch.bench_tp", "the same offline workload at each --tp-size"),
    "weights": ("tandem.launch.bench_weights", "what a weight update costs, split into its parts"),
    "moe": ("tandem.launch.bench_moe", "a mixture of experts' decode: the fused MoE op against a per-expert loop"),
}
_COMMANDS = {
    "serve": "launch the server (HTTP, OpenAI, gRPC); `tandem serve --help` lists its flags",
    "generate": "run one prompt through the model, no server",
    "bench": "the benchmarks; `tandem bench --help` lists them",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem-serve")
    except PackageNotFoundError:
        return "unknown (not installed)"


# what a benchmark imports beyond the core install (the `bench` extra has them all)
_BENCH_NEEDS = {"serving": ("aiohttp",), "soak": ("aiohttp",), "logprobs": ("aiohttp",), "offline": ("accelerate",)}


def _missing(bench: str, argv: list[str]) -> list[str]:
    """The packages `bench` needs that are not installed; checked before it starts, so a run does
    not fail minutes in and lose what it measured."""
    needs = _BENCH_NEEDS.get(bench, ())
    if bench == "offline" and "--skip-transformers" in argv:
        needs = ()
    if "--plot" in argv:
        needs = (*needs, "matplotlib")
    return [name for name in needs if importlib.util.find_spec(name) is None]


def _usage() -> str:
    lines = ["usage: tandem {serve,generate,bench} ... | tandem --version", "", "commands:"]
    lines += [f"  {name:<10} {what}" for name, what in _COMMANDS.items()]
    return "\n".join(lines)


def _bench_usage() -> str:
    lines = ["usage: tandem bench {" + ",".join(_BENCHES) + "} [--help | ...]", "", "benchmarks:"]
    lines += [f"  {name:<13} {what}" for name, (_, what) in _BENCHES.items()]
    return "\n".join(lines)


def _generate(argv: list[str]) -> int:
    from tandem.launch.bare_loop import BareLoop, LoopSampling
    from tandem.runtime.model.runner import ModelRunner
    from tandem.runtime.server_args import ServerArgs
    from tandem.runtime.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="tandem generate", description="Run one prompt through the model (no server)")
    parser.add_argument("prompt")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    args = parser.parse_args(argv)
    tok = load_tokenizer(args.model_path)
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tok.encode(args.prompt, add_special_tokens=False)
    runner = ModelRunner(ServerArgs(model_path=args.model_path, dtype=args.dtype,
                                    max_total_tokens=len(ids) + args.max_new_tokens + 8, max_running_requests=1))
    out = BareLoop(runner).generate([list(ids)], args.max_new_tokens,
                                    LoopSampling(temperature=args.temperature, seed=args.seed)).output_ids[0]
    if eos := [i for i, t in enumerate(out) if t == tok.eos_token_id]:
        out = out[:eos[0]]
    print(tok.decode(out, skip_special_tokens=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("-V", "--version"):
        print(f"tandem {_version()}")
        return 0
    if cmd == "serve":
        from tandem.launch.server import main as serve_main

        return serve_main(rest)
    if cmd == "generate":
        return _generate(rest)
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(_bench_usage())
            return 0
        if not rest or rest[0] not in _BENCHES:
            print(_bench_usage(), file=sys.stderr)
            return 2
        if missing := _missing(rest[0], rest[1:]):
            print(f"tandem bench {rest[0]} needs {', '.join(missing)}: pip install 'tandem-serve[bench]'",
                  file=sys.stderr)
            return 2
        return int(importlib.import_module(_BENCHES[rest[0]][0]).main(rest[1:]) or 0)
    print(f"tandem: unknown command {cmd!r}\n{_usage()}", file=sys.stderr)
    return 2

if __name__ == "__main__":
    sys.exit(main())

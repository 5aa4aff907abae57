"""The Python stages of `launch/gpu_check.sh` (`python -m tandem.launch.gpu_check_stages CMD`).

  env          torch / triton / CUDA versions and the GPU's compute capability
  requirements which of tandem-serve's declared requirements this Python lacks or has off-pin
  reference    greedy outputs of a server (CPU, fp32 by default) written as JSON: the reference
  greedy       a server (--attention-backend triton) against a reference JSON
  determinism  one server: each prompt alone, again over its cached prefix, and inside a batch
  summarize    one line from a bench's JSON output (one-batch, offline, kernels)

Each command prints detail, then one last line `summary: ...`, which the shell script shows as
the stage's result; the exit code says pass (0) or fail.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# Plain text prompts: a model's continuation of real text has clear winners, so greedy tokens
# rarely sit on near-ties (random token ids would).
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "1, 2, 3, 4, 5,",
)
# Prompts that share the batch with the checked ones in the determinism stage.
OTHERS = tuple(f"Write item {i} of a shopping list, then explain why it matters:" + " really" * (i % 5)
               for i in range(32))
TIE_GAP = 0.02  # nats between top-1 and top-2: a divergence at a gap this small is a near-tie, not a bug
LOGPROB_TOL = 0.01  # max |logprob difference| over the tokens that agree (fp32 GPU vs fp32 CPU)
SERVER_TOKENS = "--max-total-tokens 32768"  # small pool: a GPU's default 0.85 of memory is slow to allocate


def _on_sigterm(signum: int, frame: object) -> None:
    # The stage's `timeout` sends SIGTERM; as an exit, the server context managers still stop
    # their servers (which run in their own sessions, out of the signal's reach).
    raise SystemExit(128 + signum)


# ---------------------------------------------------------------- env, requirements


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "missing"
    cuda = torch.cuda.is_available()
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton_version,
            "cuda_available": cuda, "python": sys.version.split()[0],
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "")}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"sm_{props.major}{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1))
    for key, value in info.items():
        print(f"{key}: {value}")
    _write_json(args.json, info)
    where = (f"{info['device']} {info['capability']}, {info['sms']} SMs, {info['memory_gib']} GiB" if cuda
             else "no CUDA device")
    print(f"summary: torch {info['torch']} (CUDA {info['torch_cuda']}), triton {triton_version}, {where}")
    return 0 if cuda or not args.need_cuda else 1


def unmet_requirements(dist: str = "tandem-serve") -> list[str]:
    """Each requirement of `dist` (extras aside) that is not installed or whose version is off."""
    from importlib import metadata

    from packaging.requirements import Requirement

    unmet = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{req.name} missing")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req.name} {have} (wants {req.specifier})")
    return unmet


def cmd_requirements(args: argparse.Namespace) -> int:
    unmet = unmet_requirements()
    print(f"summary: {'; '.join(unmet) if unmet else 'every requirement met'}")
    return 1 if unmet else 0


# ---------------------------------------------------------------- servers and requests


def _model_path(arg: str | None) -> str:
    from tandem.runtime.model_files import default_model_path

    return arg or default_model_path()


def model_identity(path: str) -> dict:
    """Name, size and sha256 of a model file (or of a folder's files), so a reference made on
    another checkpoint is refused instead of reported as a mismatch."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return {"name": p.name, "bytes": sum(f.stat().st_size for f in files), "sha256": digest.hexdigest()}


class Server:
    """A managed server (launch/managed_server.py) whose pid goes to $GPU_CHECK_PIDFILE, so the
    shell can still end it should this process be killed before it stops it."""

    def __init__(self, args: str):
        self.args = args

    def __enter__(self) -> "Server":
        from tandem.launch.managed_server import start_server

        self._cm = start_server(self.args + " --log-level warning", timeout_s=240.0)
        self.url, proc = self._cm.__enter__()
        pidfile = os.environ.get("GPU_CHECK_PIDFILE")
        if pidfile:
            with open(pidfile, "a") as f:
                f.write(f"{proc.pid}\n")
        return self

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)

    def post(self, path: str, body: dict) -> dict:
        import requests

        resp = requests.post(self.url + path, json=body, timeout=600)
        resp.raise_for_status()
        return resp.json() if resp.content.startswith((b"{", b"[")) else {}

    def generate(self, text: str | list[str], max_new: int) -> dict | list[dict]:
        return self.post("/generate", {"text": text, "return_logprob": True, "top_logprobs_num": 2,
                                       "sampling_params": {"max_new_tokens": max_new, "temperature": 0}})


def row(out: dict) -> dict:
    """What a check compares from one /generate answer: output ids, their logprobs, and the gap
    between the top two logprobs at each position (how close greedy was to another token)."""
    meta = out["meta_info"]
    tops = meta["output_top_logprobs"]
    return {"output_ids": out["output_ids"], "logprobs": [lp[0] for lp in meta["output_token_logprobs"]],
            "gaps": [t[0][0] - t[1][0] if len(t) > 1 else float("inf") for t in tops],
            "cached_tokens": meta.get("cached_tokens")}


# ---------------------------------------------------------------- greedy against a reference


@dataclass
class Verdict:
    exact: int  # prompts whose tokens all agree
    near_ties: list[tuple[int, int, float]]  # (prompt, position, reference gap) of tolerated divergences
    failures: list[str]
    max_logprob_diff: float  # over the positions where the tokens agree

    @property
    def ok(self) -> bool:
        return not self.failures


def compare(reference: list[dict], got: list[dict], tie_gap: float = TIE_GAP,
            logprob_tol: float = LOGPROB_TOL) -> Verdict:
    """Greedy tokens must agree, except from a position where the reference's top two tokens
    were within `tie_gap` (another arithmetic may rightly pick the other one there); logprobs of
    the agreeing tokens must be within `logprob_tol`."""
    verdict = Verdict(0, [], [], 0.0)
    if len(reference) != len(got):
        verdict.failures.append(f"{len(got)} answers for {len(reference)} prompts")
        return verdict
    for i, (want, have) in enumerate(zip(reference, got)):
        a, b = want["output_ids"], have["output_ids"]
        same = next((p for p, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diffs = [abs(x - y) for x, y in zip(want["logprobs"][:same], have["logprobs"][:same])]
        verdict.max_logprob_diff = max([verdict.max_logprob_diff, *diffs])
        if diffs and max(diffs) > logprob_tol:
            verdict.failures.append(f"prompt {i}: logprob off by {max(diffs):.3g} (> {logprob_tol})")
        if a == b:
            verdict.exact += 1
        elif same < len(a) and same < len(b) and want["gaps"][same] < tie_gap:
            verdict.near_ties.append((i, same, want["gaps"][same]))
        else:
            gap = want["gaps"][same] if same < len(want["gaps"]) else None
            verdict.failures.append(f"prompt {i}: diverges at token {same} (reference top-2 gap {gap}): "
                                    f"want {a[same:same + 4]}, got {b[same:same + 4]}")
    return verdict


def cmd_reference(args: argparse.Namespace) -> int:
    path = _model_path(args.model_path)
    prompts = list(PROMPTS[:args.prompts])
    server_args = f"--model-path {shlex.quote(path)} --dtype {args.dtype} {SERVER_TOKENS} {args.server_args}"
    with Server(server_args) as server:
        rows = [row(out) for out in server.generate(prompts, args.max_new)]
    import torch

    ref = {"model": model_identity(path), "dtype": args.dtype, "server_args": args.server_args,
           "torch": torch.__version__, "max_new_tokens": args.max_new,
           "rows": [{"text": t, **{k: r[k] for k in ("output_ids", "logprobs", "gaps")}} for t, r in zip(prompts, rows)]}
    Path(args.out).write_text(dump_reference(ref))
    print(f"summary: {len(rows)} reference answers of {args.max_new} tokens from {path} written to {args.out}")
    return 0


def dump_reference(ref: dict) -> str:
    """JSON with one prompt's row a line: the shipped reference stays small and diffs well."""
    head = json.dumps({k: v for k, v in ref.items() if k != "rows"})
    rows = ",\n".join(" " + json.dumps(r) for r in ref["rows"])
    return f'{head[:-1]}, "rows": [\n{rows}\n]}}\n'


def cmd_greedy(args: argparse.Namespace) -> int:
    ref = json.loads(Path(args.reference).read_text())
    path = _model_path(args.model_path)
    if (have := model_identity(path)) != ref["model"]:
        print(f"summary: FAIL the reference was made on {ref['model']}, this model is {have}")
        return 1
    texts = [r["text"] for r in ref["rows"]]
    server_args = f"--model-path {shlex.quote(path)} --dtype {args.dtype} {SERVER_TOKENS} {args.server_args}"
    with Server(server_args) as server:
        got = [row(out) for out in server.generate(texts, ref["max_new_tokens"])]
    verdict = compare(ref["rows"], got)
    for problem in verdict.failures:
        print(f"  - {problem}")
    _write_json(args.json, {"exact": verdict.exact, "near_ties": verdict.near_ties, "failures": verdict.failures,
                            "max_logprob_diff": verdict.max_logprob_diff, "got": got})
    ties = f", {len(verdict.near_ties)} part at a near-tie" if verdict.near_ties else ""
    print(f"summary: {verdict.exact}/{len(texts)} prompts match the reference "
          f"exactly{ties}; max |logprob diff| {verdict.max_logprob_diff:.2g} ({args.server_args.strip()})")
    return 0 if verdict.ok else 1


# ---------------------------------------------------------------- determinism


def _answer(out: dict) -> tuple:
    meta = out["meta_info"]
    return out["output_ids"], meta["output_token_logprobs"], meta["output_top_logprobs"]


def cmd_determinism(args: argparse.Namespace) -> int:
    """The same bits alone (empty cache), again over its cached prompt, and among others."""
    prompts, others = list(PROMPTS[:args.prompts]), list(OTHERS[:args.others])
    server_args = f"--model-path {shlex.quote(_model_path(args.model_path))} --dtype {args.dtype} " \
                  f"{SERVER_TOKENS} {args.server_args}"
    with Server(server_args) as server:
        alone, cached = [], []
        for text in prompts:  # the second run of a prompt finds it in the radix cache
            server.post("/flush_cache", {})
            alone.append(server.generate(text, args.max_new))
            cached.append(server.generate(text, args.max_new))
        mixed = others[:len(others) // 2] + prompts + others[len(others) // 2:]
        with ThreadPoolExecutor(len(mixed)) as pool:  # concurrent requests share decode batches
            batched = list(pool.map(lambda t: server.generate(t, args.max_new), mixed))
        batched = batched[len(others) // 2:len(others) // 2 + len(prompts)]
    same_cached = sum(_answer(a) == _answer(c) for a, c in zip(alone, cached))
    same_batched = sum(_answer(a) == _answer(b) for a, b in zip(alone, batched))
    hits = sum((c["meta_info"].get("cached_tokens") or 0) > 0 for c in cached)
    ok = same_cached == same_batched == len(prompts)
    _write_json(args.json, {"prompts": len(prompts), "same_cached": same_cached, "same_batched": same_batched,
                            "cache_hits": hits})
    print(f"summary: ids and logprobs (==): alone vs cached {same_cached}/{len(prompts)} "
          f"({hits} cache hits), alone vs among {len(others)} others {same_batched}/{len(prompts)} "
          f"({args.server_args.strip()})")
    return 0 if ok else 1


# ---------------------------------------------------------------- bench summaries


def cmd_summarize(args: argparse.Namespace) -> int:
    text = Path(args.file).read_text()
    if args.kind == "one-batch":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        parts = [f"bs {r['batch_size']}: prefill {r['prefill_throughput_tok_s']:.0f} tok/s, decode "
                 f"{r['median_decode_latency_s'] * 1e3:.2f} ms/step ({r['decode_throughput_tok_s']:.0f} tok/s)"
                 for r in rows]
        print(f"summary: {rows[0]['dtype'] if rows else ''} " + "; ".join(parts))
        return 0 if rows else 1
    r = json.loads(text)
    if args.kind == "kernels":
        return _summarize_kernels(r)
    print(f"summary: tandem {r['tandem_overlap_tok_s']} tok/s (overlap off {r['tandem_no_overlap_tok_s']}), "
          f"bare loop {r['bare_tok_s']}, transformers {r['transformers_tok_s']}; tandem / transformers "
          f"{r['tandem_over_transformers']}x, {r['dtype']}, {r['num_seqs']} seqs")
    return 0


def _summarize_kernels(report: dict) -> int:
    """The best memory rate of each attention kernel, as a share of the device's peak."""
    from tandem.launch.bench_kernels import peak_gbps

    peak, parts = peak_gbps(report["device"]), []
    for kernel in ("decode_attention", "extend_attention"):
        rows = [r for r in report["rows"] if r["kernel"] == kernel]
        if not rows:
            continue
        best = max(rows, key=lambda r: r["gbytes"] / r["triton_us"])
        gbs = best["gbytes"] / (best["triton_us"] * 1e-6)
        share = f" = {100 * gbs / peak:.0f}% of {peak:.0f}" if peak else ""
        parts.append(f"{kernel} up to {gbs:.0f} GB/s{share} ({best['shape']})")
    print(f"summary: {report['device']}: {len(report['rows'])} rows; " + "; ".join(parts))
    return 0 if report["rows"] else 1


# ---------------------------------------------------------------- main


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tandem.launch.gpu_check_stages", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    env = sub.add_parser("env")
    env.add_argument("--need-cuda", action="store_true", help="fail without a CUDA device")
    sub.add_parser("requirements")
    for name in ("reference", "greedy", "determinism"):
        p = sub.add_parser(name)
        p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2 GGUF")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--server-args", default="", help="more server flags, as one string")
        if name != "greedy":
            p.add_argument("--prompts", type=int, default=len(PROMPTS))
            p.add_argument("--max-new", type=int, default=32)
    sub.choices["reference"].add_argument("--out", required=True)
    sub.choices["greedy"].add_argument("--reference", required=True)
    sub.choices["determinism"].add_argument("--others", type=int, default=16)
    summarize = sub.add_parser("summarize")
    summarize.add_argument("kind", choices=["one-batch", "offline", "kernels"])
    summarize.add_argument("file")
    for p in sub.choices.values():
        p.add_argument("--json", default=None, help="also write the result here")
    return parser


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    args = _parser().parse_args(argv)
    commands = {"env": cmd_env, "requirements": cmd_requirements, "reference": cmd_reference, "greedy": cmd_greedy,
                "determinism": cmd_determinism, "summarize": cmd_summarize}
    try:
        return commands[args.cmd](args)
    except Exception as exc:  # the traceback for the log, then the reason as the stage's result line
        traceback.print_exc()
        print(f"summary: {args.cmd}: {type(exc).__name__}: {exc}"[:400])
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""`tandem bench logprobs`: cost of returning prompt top logprobs nested vs flat vs flat+b64.

For each format, one timed round is: server-side build of the meta_info fields from float32 /
int32 arrays + orjson encode + client-side decode (orjson.loads, then numpy arrays for the
flat formats). All formats run in the same process and run, so the ratios are comparable;
the median of `--repeats` rounds is reported.

With `--base-url URL` (a running tandem server) or `--launch` (start one, always stop it) it
also times one real prompt-scoring request per format end to end: a random `--e2e-prompt-len`
token prompt, `max_new_tokens` 0, top-k prompt logprobs from position 0; client wall time from
sending the request to the top logprobs decoded into numpy arrays, median of `--e2e-repeats`.
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson

from tandem.launch.bench_serving import BenchError, _join_server_args, launched_server
from tandem.runtime.sampling.logprob_format import (
    decode_flat_top,
    encode_json,
    flat_top_fields,
    gc_paused,
    nested_top_rows,
)

# Formats in table order; "flat_np" is tandem's numpy pass-through variant of "flat"
# (orjson serializes the float32 arrays directly; needs OPT_SERIALIZE_NUMPY on the server).
FORMATS = ("nested", "flat", "flat_np", "b64")


def make_top_arrays(positions: int, k: int, vocab: int = 49152, seed: int = 0):
    """Synthetic prompt top-k rows: first position null (NaN / -1), like a real prompt."""
    rng = np.random.default_rng(seed)
    vals = -np.sort(rng.exponential(2.0, (positions, k)).astype(np.float32), axis=1)[:, ::-1]
    vals = np.ascontiguousarray(vals)
    idx = rng.integers(0, vocab, (positions, k), dtype=np.int32)
    vals[:1], idx[:1] = np.nan, -1
    return vals, idx


def _server(fmt: str, vals: np.ndarray, idx: np.ndarray) -> bytes:
    if fmt == "nested":
        with gc_paused():  # as LogprobFormatter builds it in the server
            rows = nested_top_rows(vals, idx, 1)
        return orjson.dumps({"input_top_logprobs": rows})
    fields = flat_top_fields("input", vals, idx, 1, b64=fmt == "b64", json_arrays=fmt == "flat_np")
    return encode_json(fields) if fmt == "flat_np" else orjson.dumps(fields)


def _client(fmt: str, body: bytes) -> Any:
    meta = orjson.loads(body)
    if fmt == "nested":
        return meta["input_top_logprobs"]
    return decode_flat_top(meta, "input")


def _time_round(fmt: str, vals: np.ndarray, idx: np.ndarray) -> tuple[float, int]:
    start = time.perf_counter()
    body = _server(fmt, vals, idx)
    decoded = _client(fmt, body)
    elapsed = time.perf_counter() - start
    del decoded
    return elapsed * 1e3, len(body)


def _check_same_numbers(vals: np.ndarray, idx: np.ndarray) -> None:
    """Every format must carry the same float32 values and ids (guards the benchmark)."""
    rows = _client("nested", _server("nested", vals, idx))
    ref_v = np.asarray([[t[0] for t in r] for r in rows[1:]], np.float32)
    ref_i = np.asarray([[t[1] for t in r] for r in rows[1:]], np.int32)
    for fmt in FORMATS[1:]:
        v, i, prefix = _client(fmt, _server(fmt, vals, idx))
        if prefix != 1 or not (np.array_equal(v, ref_v) and np.array_equal(i, ref_i)):
            raise AssertionError(f"{fmt} decodes to different numbers than nested")


def run_local(positions: int = 32768, k: int = 2, repeats: int = 5,
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Offline benchmark (no server). Returns ms / bytes per format and ratios vs nested."""
    vals, idx = make_top_arrays(positions, k)
    _check_same_numbers(vals, idx)
    times: dict[str, list[float]] = {f: [] for f in FORMATS}
    sizes: dict[str, int] = {}
    for _ in range(repeats):
        for fmt in FORMATS:  # interleaved so drift in machine load hits all formats alike
            gc.collect()
            ms, size = _time_round(fmt, vals, idx)
            times[fmt].append(ms)
            sizes[fmt] = size
    result: dict[str, Any] = {"positions": positions, "k": k, "repeats": repeats}
    for fmt in FORMATS:
        result[f"{fmt}_ms"] = statistics.median(times[fmt])
        result[f"{fmt}_bytes"] = sizes[fmt]
    for fmt in FORMATS[1:]:
        result[f"{fmt}_speedup_over_nested"] = result["nested_ms"] / result[f"{fmt}_ms"]
        result[f"{fmt}_size_ratio"] = sizes[fmt] / sizes["nested"]
    if log is not None:
        log(format_table(result))
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"logprobs bench: {result['positions']} positions x k={result['k']} "
        f"(build + encode + decode, median of {result['repeats']})",
        f"{'format':<8} {'ms':>9} {'bytes':>11} {'speedup':>8} {'size':>6}",
    ]
    for fmt in FORMATS:
        speed = 1.0 if fmt == "nested" else result[f"{fmt}_speedup_over_nested"]
        size = 1.0 if fmt == "nested" else result[f"{fmt}_size_ratio"]
        lines.append(f"{fmt:<8} {result[f'{fmt}_ms']:>9.2f} {result[f'{fmt}_bytes']:>11,} "
                     f"{speed:>7.1f}x {size:>6.2f}")
    return "\n".join(lines)


# ---- end to end: one real prompt-scoring request per format ---------------------------------

E2E_FORMATS = ("nested", "flat", "b64")
_E2E_FLAGS: dict[str, dict[str, bool]] = {
    "nested": {},
    "flat": {"return_flat_raw_top_logprobs": True},
    "b64": {"return_flat_raw_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True},
}
HTTP_TIMEOUT_S = 1800.0  # a 4k-token prefill with full-vocab logprobs is slow on a CPU server


def _http(method: str, url: str, body: bytes | None = None) -> bytes:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        raise BenchError(f"{method} {url}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
    except OSError as exc:
        raise BenchError(f"{method} {url}: {exc}") from exc


def e2e_body(input_ids: list[int], k: int, fmt: str) -> bytes:
    """The scoring request: prompt logprobs from position 0, no generated tokens."""
    return orjson.dumps({
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": k,
        **_E2E_FLAGS[fmt],
    })


def _nested_arrays(rows: list[Any]) -> tuple[np.ndarray, np.ndarray, int]:
    """What a client of the nested format does: leading null rows off, triples into arrays."""
    prefix = 0
    while prefix < len(rows) and rows[prefix] is None:
        prefix += 1
    covered = rows[prefix:]
    vals = np.array([[t[0] for t in r] for r in covered], np.float32)
    idx = np.array([[t[1] for t in r] for r in covered], np.int32)
    return vals, idx, prefix


def decode_e2e(fmt: str, raw: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """(top vals [rows, k], top ids [rows, k], null prefix) from a /generate response body."""
    meta = orjson.loads(raw)["meta_info"]
    if fmt == "nested":
        if "input_top_logprobs" not in meta:
            raise BenchError("nested response has no input_top_logprobs")
        return _nested_arrays(meta["input_top_logprobs"])
    if "input_top_logprobs_shape" not in meta:
        # the server falls back to nested when it cannot build flat rows; that is not this format
        raise BenchError(f"{fmt} response carries no flat top logprobs (did the server fall back?)")
    return decode_flat_top(meta, "input")


def _e2e_round(url: str, fmt: str, body: bytes) -> tuple[float, int, tuple]:
    start = time.perf_counter()
    raw = _http("POST", url, body)
    decoded = decode_e2e(fmt, raw)
    return (time.perf_counter() - start) * 1e3, len(raw), decoded


def check_e2e_agree(decoded: dict[str, tuple[np.ndarray, np.ndarray, int]], prompt_len: int) -> None:
    """Every format must cover the whole prompt and carry the same numbers as nested."""
    ref_v, ref_i, ref_p = decoded["nested"]
    for fmt, (v, i, p) in decoded.items():
        if p + v.shape[0] != prompt_len:
            raise BenchError(f"{fmt}: {p} null + {v.shape[0]} rows for a {prompt_len}-token prompt")
        if p != ref_p or v.shape != ref_v.shape or not np.array_equal(i, ref_i):
            raise BenchError(f"{fmt}: top logprob ids or null prefix differ from nested")
        if not np.allclose(v, ref_v, rtol=1e-6, atol=1e-6):
            raise BenchError(f"{fmt}: top logprob values differ from nested "
                             f"(max diff {float(np.max(np.abs(v - ref_v))):.3g})")


def run_e2e(base_url: str, prompt_len: int = 4096, k: int = 2, repeats: int = 3, seed: int = 0,
            log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time one real scoring request per format against a running server (after one warm-up)."""
    base_url = base_url.rstrip("/")
    info = orjson.loads(_http("GET", f"{base_url}/model_info"))
    if prompt_len >= info["context_len"]:
        raise BenchError(f"--e2e-prompt-len {prompt_len} does not fit the context ({info['context_len']})")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, info["vocab_size"], prompt_len).tolist()
    bodies = {fmt: e2e_body(ids, k, fmt) for fmt in E2E_FORMATS}
    url = f"{base_url}/generate"
    # warm-up round doubles as the correctness check, so timed rounds measure only the formats
    check_e2e_agree({fmt: _e2e_round(url, fmt, bodies[fmt])[2] for fmt in E2E_FORMATS}, prompt_len)
    times: dict[str, list[float]] = {f: [] for f in E2E_FORMATS}
    sizes: dict[str, int] = {}
    for _ in range(repeats):
        for fmt in E2E_FORMATS:  # interleaved, like run_local
            gc.collect()
            ms, sizes[fmt], _ = _e2e_round(url, fmt, bodies[fmt])
            times[fmt].append(ms)
    result: dict[str, Any] = {"e2e_prompt_len": prompt_len, "e2e_k": k, "e2e_repeats": repeats}
    for fmt in E2E_FORMATS:
        result[f"e2e_{fmt}_ms"] = statistics.median(times[fmt])
        result[f"e2e_{fmt}_bytes"] = sizes[fmt]
    for fmt in E2E_FORMATS[1:]:
        result[f"e2e_{fmt}_speedup_over_nested"] = result["e2e_nested_ms"] / result[f"e2e_{fmt}_ms"]
    if log is not None:
        log(format_e2e_table(result))
    return result


def format_e2e_table(result: dict[str, Any]) -> str:
    lines = [
        f"logprobs e2e: {result['e2e_prompt_len']}-token prompt x k={result['e2e_k']} "
        f"(POST /generate -> numpy arrays, median of {result['e2e_repeats']})",
        f"{'format':<8} {'ms':>9} {'bytes':>11} {'speedup':>8}",
    ]
    for fmt in E2E_FORMATS:
        speed = 1.0 if fmt == "nested" else result[f"e2e_{fmt}_speedup_over_nested"]
        lines.append(f"{fmt:<8} {result[f'e2e_{fmt}_ms']:>9.2f} {result[f'e2e_{fmt}_bytes']:>11,} "
                     f"{speed:>7.2f}x")
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench logprobs", description=__doc__)
    p.add_argument("--positions", type=int, default=32768)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-file", type=Path, default=None, help="write the results as JSON")
    e = p.add_argument_group("end to end (needs --base-url or --launch)")
    e.add_argument("--base-url", default=None, help="a running tandem server, e.g. http://127.0.0.1:30000")
    e.add_argument("--launch", action="store_true", help="start a tandem server on a free port for the run")
    e.add_argument("--server-args", default="", help="one quoted string passed to the launched server")
    e.add_argument("--server-module", default="tandem.launch.server", help="module run by --launch")
    e.add_argument("--launch-timeout", type=float, default=300.0, help="seconds to wait for /health")
    e.add_argument("--e2e-prompt-len", type=int, default=4096, help="random prompt tokens (< context)")
    e.add_argument("--e2e-repeats", type=int, default=3)
    e.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    return p


# flushed, so the tables do not interleave with a launched server's own output
_print = functools.partial(print, flush=True)


def _run_e2e(args: argparse.Namespace) -> dict[str, Any]:
    if args.launch:
        with launched_server(args) as base_url:
            return run_e2e(base_url, args.e2e_prompt_len, args.k, args.e2e_repeats, args.seed, log=_print)
    return run_e2e(args.base_url, args.e2e_prompt_len, args.k, args.e2e_repeats, args.seed, log=_print)


def main(argv: list[str] | None = None) -> int:
    # --server-args "--flag ..." must reach argparse as one value
    args = _parser().parse_args(_join_server_args(list(sys.argv[1:] if argv is None else argv)))
    if min(args.positions, args.k, args.repeats, args.e2e_prompt_len, args.e2e_repeats) < 1:
        raise SystemExit("--positions, --k, --repeats, --e2e-prompt-len and --e2e-repeats must be positive")
    if args.launch and args.base_url:
        raise SystemExit("give --base-url or --launch, not both")
    result = run_local(args.positions, args.k, args.repeats, log=_print)
    if args.launch or args.base_url:
        _print()
        try:
            result.update(_run_e2e(args))
        except BenchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.output_file is not None:
        args.output_file.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

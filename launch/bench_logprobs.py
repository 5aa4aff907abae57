"""`tandem bench logprobs`: cost of returning prompt top logprobs nested vs flat vs flat+b64.

For each format, one timed round is: server-side build of the meta_info fields from float32 /
int32 arrays + orjson encode + client-side decode (orjson.loads, then numpy arrays for the
flat formats). All formats run in the same process and run, so the ratios are comparable;
the median of `--repeats` rounds is reported.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson

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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench logprobs", description=__doc__)
    p.add_argument("--positions", type=int, default=32768)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-file", type=Path, default=None, help="write the results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.positions < 1 or args.k < 1 or args.repeats < 1:
        raise SystemExit("--positions, --k and --repeats must be positive")
    result = run_local(args.positions, args.k, args.repeats, log=print)
    if args.output_file is not None:
        args.output_file.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

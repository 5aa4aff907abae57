"""The client side of `tandem bench serving`: streaming /generate requests at a given rate, each
chunk recorded as SGLang's harness records it, and the report of a run. bench_serving (the CLI and
its modes) and bench_chat (the --tools comparison) both drive it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
from typing import Any

import aiohttp
import numpy as np
import orjson

from tandem.launch.bench_datasets import DatasetRow
from tandem.launch.bench_progress import bar
from tandem.launch.managed_server import BenchError
from tandem.launch.bench_metrics import (
    RequestResult,
    compute_metrics,
    finish_request,
    format_result_block,
    plot_results,
    record_chunk,
)
from tandem.runtime.frontend.request_groups import stream_error


# same knobs SGLang's harness uses: long streams must not time out, big chunks must fit
HTTP_TIMEOUT_S = 6 * 3600
READ_BUFSIZE = 10 * 1024**2
WARMUP_MAX_NEW_TOKENS = 32


class StreamError(RuntimeError):
    """The server reported an error inside an otherwise healthy stream."""


# ---------------------------------------------------------------- one request


def build_payload(prompt: str | list[int], max_new_tokens: int, args: Any) -> dict[str, Any]:
    """The body SGLang's harness posts to /generate for its native backend."""
    payload: dict[str, Any] = {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": not args.disable_ignore_eos,
        },
        "stream": True,
        "lora_path": None,
        "return_logprob": args.return_logprob,
        "logprob_start_len": -1,
    }
    if getattr(args, "json_schema_text", None):
        payload["sampling_params"]["json_schema"] = args.json_schema_text
    payload.update(args.extra_body)
    return payload


def _chunk_tokens(data: dict[str, Any], res: RequestResult) -> int:
    """Cumulative output length of a chunk: completion_tokens (as SGLang reads it), else
    len(output_ids), else +1 whenever the cumulative text grew."""
    meta = data.get("meta_info") or {}
    if meta.get("completion_tokens") is not None:
        return int(meta["completion_tokens"])
    if data.get("output_ids") is not None:
        return len(data["output_ids"])
    grew = len(data.get("text") or "") > len(res.text)
    return res.tokens_seen + int(grew)


def apply_chunk(res: RequestResult, data: dict[str, Any], now: float) -> None:
    """Fold one decoded SSE chunk into the request's record."""
    if "error" in data:
        err = data["error"]
        raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
    if (failed := stream_error(data)) is not None:  # SGLang ends a failed stream with an abort chunk
        raise StreamError(f"{failed.status_code}: {failed.message}")
    meta = data.get("meta_info") or {}
    total = _chunk_tokens(data, res)
    res.output_len = total
    res.cached_tokens = int(meta.get("cached_tokens") or res.cached_tokens)
    if meta.get("prompt_tokens"):
        # the server's count is exact; the dataset's is an estimate for text prompts
        res.prompt_len = int(meta["prompt_tokens"])
    if isinstance(data.get("text"), str):
        res.text = data["text"]
    record_chunk(res, now, total)


async def _consume_stream(resp: aiohttp.ClientResponse, res: RequestResult, apply: Any = None) -> None:
    """Each SSE data line to `apply` (default: a /generate chunk), then the request's end."""
    apply = apply or apply_chunk
    last = time.perf_counter()
    async for raw in resp.content:
        line = raw.strip()
        if not line or line.startswith(b":"):  # an SSE comment: a proxy's keep-alive (smg sends them)
            continue
        last = time.perf_counter()
        body = line[5:].strip() if line.startswith(b"data:") else line
        if body == b"[DONE]":
            continue
        apply(res, orjson.loads(body), last)
    finish_request(res, last)


async def send_request(
    session: aiohttp.ClientSession, api_url: str, row: DatasetRow, args: Any,
    max_new_tokens: int | None = None,
) -> RequestResult:
    """Stream one /generate request; any failure is recorded on the result, never raised."""
    payload = build_payload(row.prompt, max_new_tokens or row.output_len, args)
    return await stream_request(session, api_url, payload, row.prompt_len)


async def stream_request(session: aiohttp.ClientSession, api_url: str, payload: dict[str, Any], prompt_len: int,
                         apply: Any = None) -> RequestResult:
    """POST `payload` and record its SSE stream chunk by chunk (`apply`: how a chunk counts; default
    a /generate chunk); any failure is recorded on the result, never raised."""
    res = RequestResult(prompt_len=prompt_len)
    res.start = time.perf_counter()
    try:
        async with session.post(api_url, json=payload) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
            else:
                await _consume_stream(resp, res, apply)
    except Exception as exc:  # noqa: BLE001 - a bad request must not end the run
        res.success = False
        res.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if not res.success:
        res.latency = time.perf_counter() - res.start  # failed requests still occupied a slot
    return res


# ---------------------------------------------------------------- the run


async def _arrivals(rows: list[DatasetRow], rate: float, seed: int) -> Any:
    """Yield rows with Poisson (exponential-gap) arrivals; rate inf sends all at once."""
    rng = np.random.default_rng(seed)
    for row in rows:
        yield row
        if math.isfinite(rate):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


def _progress_bar(total: int, args: Any) -> Any:
    """Requests done, on stderr where it is a terminal (launch/bench_progress.py)."""
    return bar(total, "requests", unit="req", disable=args.disable_tqdm)


async def _warmup(session: aiohttp.ClientSession, api_url: str, row: DatasetRow, args: Any, send: Any) -> None:
    if args.warmup_requests <= 0:
        return
    n_tokens = min(row.output_len, WARMUP_MAX_NEW_TOKENS)
    outs = await asyncio.gather(*(send(session, api_url, row, args, n_tokens)
                                  for _ in range(args.warmup_requests)))
    if not any(o.success for o in outs):
        raise BenchError(f"warmup failed, check the arguments and the server: {outs[0].error}")


async def run_benchmark(
    args: Any, rows: list[DatasetRow], base_url: str, send: Any = send_request, path: str = "/generate"
) -> tuple[list[RequestResult], float, float]:
    """Send every row under the configured load shape; returns results, duration, start time.
    `send` streams one row to `path` (default: SGLang's native /generate)."""
    api_url = f"{base_url}{path}"
    connector = aiohttp.TCPConnector(limit=0)  # the semaphore, not aiohttp, caps concurrency
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S),
        read_bufsize=READ_BUFSIZE,
    ) as session:
        await _warmup(session, api_url, rows[0], args, send)
        if args.flush_cache:
            async with session.post(f"{base_url}/flush_cache", json={}) as resp:
                await resp.read()
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        pbar = _progress_bar(len(rows), args)

        async def one(row: DatasetRow) -> RequestResult:
            async with sem if sem is not None else contextlib.nullcontext():
                res = await send(session, api_url, row, args)
            pbar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(row))
                 async for row in _arrivals(rows, args.request_rate, args.seed)]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        pbar.close()
    return results, duration, t0


# ---------------------------------------------------------------- --launch


def _finite(value: Any) -> Any:
    # strict JSON has no Infinity/NaN; "inf" keeps the request rate readable
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def build_result(args: Any, metrics: dict[str, Any], results: list[RequestResult]) -> dict[str, Any]:
    run = {k: getattr(args, k) for k in (
        "backend", "dataset_name", "request_rate", "max_concurrency", "num_prompts",
        "random_input_len", "random_output_len", "random_range_ratio", "seed")}
    result = {**run, **metrics, "duration": metrics["duration_s"],
              "errors": [r.error for r in results if not r.success]}
    if args.output_details:
        result.update(input_lens=[r.prompt_len for r in results],
                      output_lens=[r.output_len for r in results],
                      ttfts=[r.ttft for r in results], itls=[r.itl for r in results])
    return {k: _finite(v) for k, v in result.items()}


def report(args: Any, results: list[RequestResult], duration: float, t0: float,
           accept_length: float | None = None) -> dict[str, Any]:
    metrics = compute_metrics(results, duration, t0)
    metrics["accept_length"] = accept_length
    header = {"Backend": args.backend, "Traffic request rate": args.request_rate,
              "Max request concurrency": args.max_concurrency or "not set"}
    print("\n" + format_result_block(metrics, header), flush=True)
    result = build_result(args, metrics, results)
    if result["errors"]:
        print(f"First error: {result['errors'][0]}", file=sys.stderr)
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot_results(results, t0, args.plot)
    return result

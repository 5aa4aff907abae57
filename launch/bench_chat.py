"""`tandem bench serving --tools FILE`: what parsing tool calls out of a stream costs.

The same rows are streamed through /v1/chat/completions without tools and with them
(tool_choice auto: the server renders nothing new for an id prompt, and parses every step of the
answer with its --tool-call-parser), in alternating rounds with the cache flushed before each, so
a drift of the machine hits both sides alike. Token counts come from the stream's continuous usage
(SGLang's stream_options.continuous_usage_stats), so a step the parser holds back is counted in the
chunk that finally shows it. The report is each side's latencies and the ratio of mean inter-token
latency, with tools over without (issue 50's target: under 1.05).
"""
from __future__ import annotations

import asyncio
import copy
import json
import statistics
from typing import Any

import aiohttp

from tandem.launch.bench_datasets import DatasetRow
from tandem.launch.bench_metrics import RequestResult, record_chunk
from tandem.launch.bench_client import StreamError, report, run_benchmark, stream_request
from tandem.launch.bench_serving_ab import flush_cache


def chat_payload(row: DatasetRow, max_tokens: int, args: Any, tools: list | None) -> dict[str, Any]:
    """A streamed chat request for `row`: its text as the user's message, or its ids as SGLang's
    input_ids extension (no template: the same prompt with and without tools)."""
    body: dict[str, Any] = {"model": "default", "stream": True, "temperature": 0.0, "max_tokens": max_tokens,
                            "ignore_eos": not args.disable_ignore_eos,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if isinstance(row.prompt, str):
        body["messages"] = [{"role": "user", "content": row.prompt}]
    else:
        body.update(messages=[{"role": "user", "content": "-"}], input_ids=row.prompt)
    if tools:
        body.update(tools=tools, tool_choice="auto")
    body.update(args.extra_body)
    return body


async def send_chat_request(session: aiohttp.ClientSession, api_url: str, row: DatasetRow, args: Any,
                            max_new_tokens: int | None = None) -> RequestResult:
    """Stream one chat request (with args.chat_tools when set); failures are recorded, never raised."""
    payload = chat_payload(row, max_new_tokens or row.output_len, args, getattr(args, "chat_tools", None))
    return await stream_request(session, api_url, payload, row.prompt_len, _apply_chat_chunk)


def _apply_chat_chunk(res: RequestResult, data: dict[str, Any], now: float) -> None:
    if "error" in data and data.get("object") == "error":
        raise StreamError(data["error"].get("message", "error"))
    usage = data.get("usage")
    if not usage:
        return
    if usage.get("prompt_tokens"):
        res.prompt_len = int(usage["prompt_tokens"])
    shows = any(choice.get("delta") for choice in data.get("choices") or [])
    if shows or not data.get("choices"):  # a chunk that shows output, or the final usage chunk
        res.output_len = int(usage["completion_tokens"])
        record_chunk(res, now, res.output_len)


def compare_tools(args: Any, rows: list[DatasetRow], base_url: str) -> dict[str, Any]:
    with open(args.tools, encoding="utf-8") as f:
        tools = json.load(f)
    sides: dict[str, list[dict[str, Any]]] = {"without_tools": [], "with_tools": []}
    for r in range(args.tools_rounds):
        for name in sides:
            each = copy.copy(args)
            each.output_file, each.plot, each.flush_cache = None, None, False
            each.chat_tools = tools if name == "with_tools" else None
            flush_cache(base_url)
            print(f"\n== round {r + 1}/{args.tools_rounds}: chat {name.replace('_', ' ')}", flush=True)
            results, duration, t0 = asyncio.run(
                run_benchmark(each, rows, base_url, send_chat_request, "/v1/chat/completions"))
            sides[name].append(report(each, results, duration, t0))
    itl = {name: statistics.mean(run["mean_itl_ms"] for run in runs) for name, runs in sides.items()}
    ratio = itl["with_tools"] / itl["without_tools"] if itl["without_tools"] else None
    print(f"\nmean ITL without tools {itl['without_tools']:.3f} ms, with tools {itl['with_tools']:.3f} ms: "
          f"with / without = {ratio:.4f}" if ratio else "", flush=True)
    combined = {**sides, "mean_itl_ms": itl, "with_over_without_itl": ratio}
    if args.output_file:
        with open(args.output_file, "w", encoding="utf-8") as f:
            json.dump(combined, f, indent=2)
    return {**sides["with_tools"][-1], "with_over_without_itl": ratio}

"""`tandem bench serving` end to end against a fake SGLang-compatible server, plus datasets."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tandem.launch import bench_client, bench_serving
from tandem.launch.bench_datasets import (
    FIRST_ORDINARY_ID,
    load_conversations,
    sample_generated_shared_prefix,
    sample_random,
)
from tandem.launch.bench_metrics import RequestResult

# One source for the fake server: exec'd in-process for most tests, and run as
# `python -m fake_sglang_server` by the --launch tests. It streams cumulative SSE chunks of
# 1, 2, 1, 3, ... new tokens (multi-token chunks exercise the ITL split) and reports half the
# prompt as cached.
FAKE_SERVER_SRC = r'''
import asyncio, json, os, sys
from aiohttp import web

CHUNK_SIZES = [1, 2, 1, 3]


def make_app(log=None, fail_every=0, delay=0.003):
    state = {"n": 0}

    async def health(request):
        return web.Response(text="ok")

    async def generate(request):
        body = await request.json()
        if log is not None:
            log.append(body)
        state["n"] += 1
        if fail_every and state["n"] % fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        n_out = body["sampling_params"]["max_new_tokens"]
        n_in = len(body.get("input_ids") or body.get("text", "").split())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids, i = [], 0
        while len(ids) < n_out:
            await asyncio.sleep(delay)
            k = min(CHUNK_SIZES[i % len(CHUNK_SIZES)], n_out - len(ids))
            i += 1
            ids.extend(range(100 + len(ids), 100 + len(ids) + k))
            done = len(ids) == n_out
            meta = {"prompt_tokens": n_in, "completion_tokens": len(ids),
                    "cached_tokens": n_in // 2,
                    "finish_reason": {"type": "length", "length": n_out} if done else None}
            chunk = {"text": " ".join(f"t{t}" for t in ids), "output_ids": ids, "meta_info": meta}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    return app


if __name__ == "__main__":
    port = int(sys.argv[sys.argv.index("--port") + 1])
    with open(os.environ["FAKE_SERVER_LOG"], "w") as f:
        json.dump({"pid": os.getpid(), "argv": sys.argv[1:]}, f)
    web.run_app(make_app(), host="127.0.0.1", port=port, print=None)
'''

_ns: dict[str, Any] = {}
exec(FAKE_SERVER_SRC, _ns)  # noqa: S102 - trusted test source, shared with the subprocess
make_app = _ns["make_app"]

EXPECTED_KEYS = {
    "backend", "dataset_name", "request_rate", "max_concurrency", "num_prompts", "seed",
    "random_input_len", "random_output_len", "random_range_ratio",
    "duration_s", "duration", "completed", "failed", "errors",
    "total_input_tokens", "total_output_tokens", "total_cached_tokens", "cache_hit_rate",
    "request_throughput", "input_throughput", "output_throughput", "total_throughput",
    "peak_output_throughput", "peak_concurrent_requests", "concurrency",
} | {f"{stat}_{series}_ms" for stat in ("mean", "median", "std", "p90", "p95", "p99", "max")
     for series in ("ttft", "itl", "tpot", "e2e_latency")}


class ThreadedServer:
    """Runs an aiohttp app on a free loopback port in a background thread's event loop."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def fake_server() -> Iterator[tuple[ThreadedServer, list[dict[str, Any]]]]:
    log: list[dict[str, Any]] = []
    with ThreadedServer(make_app(log=log)) as server:
        yield server, log


def _common(url: str, tmp_path: Path, n: int = 8) -> list[str]:
    return ["--base-url", url, "--num-prompts", str(n), "--dataset-name", "random",
            "--random-input-len", "16", "--random-output-len", "8",
            "--output-file", str(tmp_path / "out.json")]


@pytest.mark.timeout(60)
def test_end_to_end_random(fake_server: Any, tmp_path: Path, capsys: Any) -> None:
    server, log = fake_server
    png = tmp_path / "plot.png"
    argv = _common(server.url, tmp_path) + ["--plot", str(png), "--output-details",
                                            "--max-concurrency", "4", "--seed", "7"]
    assert bench_serving.main(argv) == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert EXPECTED_KEYS <= set(res)
    assert res["completed"] == 8 and res["failed"] == 0 and res["errors"] == []
    rows = sample_random(8, 16, 8, 0.0, 7, 49152)
    assert res["total_input_tokens"] == sum(r.prompt_len for r in rows)
    assert res["total_output_tokens"] == sum(r.output_len for r in rows)
    assert res["total_cached_tokens"] == sum(r.prompt_len // 2 for r in rows)
    assert 0.3 < res["cache_hit_rate"] < 0.6
    assert 0 < res["mean_ttft_ms"] < res["mean_e2e_latency_ms"]
    assert res["p99_ttft_ms"] <= res["p99_e2e_latency_ms"]
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0
    assert 0 < res["concurrency"] <= 4.0 + 1e-6
    assert res["peak_concurrent_requests"] <= 4
    assert res["request_rate"] == "inf"
    # the fake's first chunk carries 1 token, so every later token adds exactly one ITL value
    for out_len, itls in zip(res["output_lens"], res["itls"]):
        assert len(itls) == out_len - 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Serving Benchmark Result" in capsys.readouterr().out
    # 1 warmup + 8 measured; payload shape exactly as SGLang's native backend sends it
    assert len(log) == 9
    body = log[1]
    assert set(body) == {"input_ids", "sampling_params", "stream", "lora_path",
                         "return_logprob", "logprob_start_len"}
    assert body["stream"] is True and body["return_logprob"] is False
    assert body["logprob_start_len"] == -1 and body["lora_path"] is None
    assert set(body["sampling_params"]) == {"temperature", "max_new_tokens", "ignore_eos"}
    assert body["sampling_params"]["temperature"] == 0.0
    assert body["sampling_params"]["ignore_eos"] is True
    assert all(FIRST_ORDINARY_ID <= t < 49152 for b in log for t in b["input_ids"])


@pytest.mark.timeout(60)
def test_failed_requests_are_counted_not_fatal(tmp_path: Path) -> None:
    with ThreadedServer(make_app(fail_every=3)) as server:
        argv = _common(server.url, tmp_path, n=6) + ["--warmup-requests", "0",
                                                     "--request-rate", "200"]
        assert bench_serving.main(argv) == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["completed"] == 4 and res["failed"] == 2
    assert all("HTTP 500" in e and "injected failure" in e for e in res["errors"])


@pytest.mark.timeout(60)
def test_all_failed_and_warmup_failure_exit_nonzero(tmp_path: Path, capsys: Any) -> None:
    with ThreadedServer(make_app(fail_every=1)) as server:
        argv = _common(server.url, tmp_path, n=3)
        assert bench_serving.main(argv + ["--warmup-requests", "0"]) == 1
        assert json.loads((tmp_path / "out.json").read_text())["failed"] == 3
        assert bench_serving.main(argv) == 1
    assert "warmup failed" in capsys.readouterr().err


def test_payload_text_prompt_and_stream_error() -> None:
    args = bench_serving.parse_args(["--extra-request-body", '{"rid": "x"}',
                                     "--disable-ignore-eos"])
    body = bench_client.build_payload("hello", 5, args)
    assert body["text"] == "hello" and "input_ids" not in body and body["rid"] == "x"
    assert body["sampling_params"]["ignore_eos"] is False
    with pytest.raises(bench_client.StreamError, match="out of memory"):
        bench_client.apply_chunk(RequestResult(), {"error": {"message": "out of memory"}}, 0.0)
    # SGLang's (and tandem's) failed stream: the usual chunk, its finish_reason an abort with a status
    failed = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {
        "type": "abort", "message": "The request queue is full.", "status_code": 503, "err_type": "ServiceUnavailable"}}}
    with pytest.raises(bench_client.StreamError, match="503: The request queue is full."):
        bench_client.apply_chunk(RequestResult(), failed, 0.0)
    aborted = {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "status_code": 200}}}
    bench_client.apply_chunk(RequestResult(), aborted, 0.0)  # a user's abort is an ordinary end


def test_server_args_pass_through_as_one_string() -> None:
    assert bench_serving.parse_args(["--server-args", "--disable-x"]).server_args == "--disable-x"
    args = bench_serving.parse_args(["--server-args", "--model-path m --tp 2", "--launch"])
    assert args.server_args == "--model-path m --tp 2" and args.launch


def _fake_module(tmp_path: Path, monkeypatch: Any, source: str) -> Path:
    (tmp_path / "fake_sglang_server.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    log = tmp_path / "server.json"
    monkeypatch.setenv("FAKE_SERVER_LOG", str(log))
    return log


@pytest.mark.timeout(60)
def test_launch_starts_and_always_stops_server(tmp_path: Path, monkeypatch: Any) -> None:
    log = _fake_module(tmp_path, monkeypatch, FAKE_SERVER_SRC)
    argv = ["--launch", "--server-module", "fake_sglang_server",
            "--server-args", "--model-path tiny --flag", "--num-prompts", "3",
            "--random-input-len", "8", "--random-output-len", "4",
            "--output-file", str(tmp_path / "out.json")]
    assert bench_serving.main(argv) == 0
    info = json.loads(log.read_text())
    assert info["argv"][0] == "--port" and info["argv"][2:] == ["--model-path", "tiny", "--flag"]
    with pytest.raises(ProcessLookupError):
        os.kill(info["pid"], 0)
    assert json.loads((tmp_path / "out.json").read_text())["completed"] == 3


@pytest.mark.timeout(60)
def test_launch_fails_loudly_when_server_dies(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    _fake_module(tmp_path, monkeypatch, "import sys\nsys.exit(3)\n")
    argv = ["--launch", "--server-module", "fake_sglang_server", "--num-prompts", "2"]
    assert bench_serving.main(argv) == 1
    assert "exited with code 3" in capsys.readouterr().err


# ---------------------------------------------------------------- datasets


class WordTokenizer:
    """Token i <-> word 'w<i>'; enough to check the text paths without model files."""

    vocab_size = 500

    def encode(self, text: str) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def test_random_dataset_ranges_and_determinism() -> None:
    rows = sample_random(50, 20, 10, 0.5, seed=3, vocab_size=100)
    assert all(10 <= r.prompt_len <= 20 and len(r.prompt) == r.prompt_len for r in rows)
    assert all(5 <= r.output_len <= 10 for r in rows)
    assert all(FIRST_ORDINARY_ID <= t < 100 for r in rows for t in r.prompt)
    assert rows == sample_random(50, 20, 10, 0.5, seed=3, vocab_size=100)
    assert rows != sample_random(50, 20, 10, 0.5, seed=4, vocab_size=100)
    fixed = sample_random(4, 6, 3, 1.0, seed=0, vocab_size=100, tokenizer=WordTokenizer())
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 6 for r in fixed)


def test_generated_shared_prefix_shapes() -> None:
    rows = sample_generated_shared_prefix(3, 4, 32, 8, 5, seed=0, vocab_size=1000)
    assert len(rows) == 12
    assert all(len(r.prompt) == r.prompt_len == 40 and r.output_len == 5 for r in rows)
    groups: dict[tuple[int, ...], list[Any]] = {}
    for r in rows:
        groups.setdefault(tuple(r.prompt[:32]), []).append(r)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4]
    # questions differ within a group, and rows are shuffled across groups
    assert all(len({tuple(r.prompt[32:]) for r in g}) == 4 for g in groups.values())
    assert [tuple(r.prompt[:32]) for r in rows[:4]] != [tuple(rows[0].prompt[:32])] * 4
    assert rows == sample_generated_shared_prefix(3, 4, 32, 8, 5, seed=0, vocab_size=1000)
    text_rows = sample_generated_shared_prefix(2, 3, 10, 4, 5, seed=1, vocab_size=0,
                                               tokenizer=WordTokenizer())
    prefixes = {r.prompt.split("\n\n")[0] for r in text_rows}
    assert len(prefixes) == 2 and all(r.prompt_len == 14 for r in text_rows)


def test_conversation_loader_jsonl_and_sharegpt(tmp_path: Path) -> None:
    records = [
        {"conversations": [{"from": "human", "value": "what is two plus two"},
                           {"from": "gpt", "value": "it is four"}]},
        {"conversations": [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "name a color"},
                           {"role": "assistant", "content": "blue is a color"}]},
        {"conversations": [{"from": "human", "value": "no reply here"}]},
        {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "a b"}]},
    ]
    jsonl = tmp_path / "conv.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    rows = load_conversations(str(jsonl), num_prompts=10, seed=0)
    got = sorted((r.prompt, r.prompt_len, r.output_len) for r in rows)
    # the reply-less record and the 1-word prompt are skipped
    assert got == [("name a color", 3, 4), ("what is two plus two", 5, 3)]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps(records))
    assert sorted(load_conversations(str(sharegpt), 10, seed=0), key=lambda r: r.prompt_len) \
        == sorted(rows, key=lambda r: r.prompt_len)
    one = load_conversations(str(jsonl), num_prompts=1, seed=0, fixed_output_len=64)
    assert len(one) == 1 and one[0].output_len == 64
    assert load_conversations(str(jsonl), 10, seed=0, context_len=7)[0].prompt == "name a color"


def test_sse_comments_are_skipped() -> None:
    """A proxy in front of the server (smg) sends `: keep-alive` comments during a long prefill."""

    class Resp:
        def __init__(self, lines: list[bytes]) -> None:
            self.content = self._iter(lines)

        @staticmethod
        async def _iter(lines: list[bytes]):
            for line in lines:
                yield line

    chunk = b'data: {"text": "ab", "output_ids": [5, 6], "meta_info": {"completion_tokens": 2}}\n'
    res = RequestResult(prompt_len=3)
    asyncio.run(bench_client._consume_stream(Resp([b": keep-alive\n", b"\n", chunk, b"data: [DONE]\n"]), res))
    assert res.success and res.output_len == 2 and res.text == "ab"

"""`tandem bench soak`: hours of hostile-but-legal traffic in minutes, and an account of every request.

Starts a server (forced retraction on, priority scheduling on) and drives it for `--minutes`
with mixed streaming and non-streaming requests: n>1, logprobs, stop strings, priorities, 30%
of clients hanging up mid-request and 20% of requests aborted through `/abort_request`.
Then it checks what a long-running server must keep true:

- every request is accounted for: finished, aborted, disconnected by its client, or rejected
  with a status; none lost (an answer without a finish reason), none hung, no 5xx;
- nothing leaks: after `/flush_cache` every KV slot and request row is free;
- memory is flat: the RSS of each process in the last quarter against the second (the first is
  warm-up: allocator arenas and oneDNN kernels for each new batch shape; a leak keeps growing);
- nothing outlives the server: no process, no IPC directory.

Prints a table and writes JSON; exits 1 when a check fails. `--plot FILE.png` draws each
process's RSS and every answered request's latency over the run.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tandem.launch.managed_server import (alive, ipc_dirs, leak_check, rss_bytes, run_checked,
                                          start_server, stop_server)
from tandem.runtime.frontend.request_groups import stream_error

REQUEST_TIMEOUT_S = 120.0  # a request still unanswered after this long counts as hung
RSS_SAMPLE_S = 2.0
STOP_STRINGS = ["\n\n", " the", "."]


@dataclass
class SoakConfig:
    minutes: float
    concurrency: int
    seed: int
    max_rss_drift: float
    server_args: str
    plot: str | None = None  # a PNG of RSS and latency over time


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)  # lost, hung and 5xx, with a short description
    tokens: int = 0
    seconds: list[float] = field(default_factory=list)  # call to answer, of each request answered in full
    answered_at: list[float] = field(default_factory=list)  # when each of those answers came (monotonic)

    def latency(self) -> dict[str, float]:
        """p50 / p99 / max seconds of the answered requests: a starved or crawling request shows
        in the tail long before it is hung."""
        if not self.seconds:
            return {}
        ordered = sorted(self.seconds)
        pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)  # noqa: E731
        return {"p50": pick(0.5), "p99": pick(0.99), "max": round(ordered[-1], 2)}

    def add(self, outcome: str, problem: str | None = None) -> None:
        self.outcomes[outcome] += 1
        if problem:
            self.problems.append(problem)


def _body(rng: random.Random, rid: str) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_new_tokens": rng.randint(1, 64), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        sp["n"] = rng.randint(2, 4)
    if rng.random() < 0.2:
        sp["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    if rng.random() < 0.5:
        sp["ignore_eos"] = True
    body: dict[str, Any] = {"rid": rid, "sampling_params": sp, "priority": rng.randint(0, 20),
                            "input_ids": [rng.randint(3, 4000) for _ in range(rng.randint(4, 160))]}
    if rng.random() < 0.3:
        body.update(return_logprob=True, top_logprobs_num=rng.randint(0, 3),
                    logprob_start_len=rng.choice([-1, 0]))
    if rng.random() < 0.5:
        body["stream"] = True
    return body


async def _read(resp: aiohttp.ClientResponse, stream: bool) -> list[dict]:
    """The final result(s) of a call: the last SSE event, or the JSON answer."""
    if not stream:
        out = await resp.json(loads=orjson.loads)
        return out if isinstance(out, list) else [out]
    last: dict[int, dict] = {}
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            event = orjson.loads(line[6:])
            if "error" in event:
                return [event]
            last[event.get("index", 0)] = event
    return list(last.values())


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random, rid: str, tally: Tally) -> None:
    body = _body(rng, rid)
    action = rng.random()
    hang_up = action < 0.3  # the client goes away mid-request
    abort = 0.3 <= action < 0.5  # the client asks the server to abort it
    t0 = time.monotonic()
    task = asyncio.ensure_future(_call(session, url, body))
    if hang_up or abort:
        await asyncio.sleep(rng.uniform(0.02, 1.0))
    if hang_up and not task.done():
        task.cancel()
        tally.add("disconnected")
        return
    if abort:
        async with session.post(f"{url}/abort_request", json={"rid": rid}) as resp:
            if resp.status != 200:
                tally.add(f"abort_request {resp.status}", f"{rid}: /abort_request answered {resp.status}")
    try:
        status, results = await asyncio.wait_for(task, REQUEST_TIMEOUT_S)
    except asyncio.TimeoutError:
        tally.add("hung", f"{rid}: no answer within {REQUEST_TIMEOUT_S:g} s")
        return
    except aiohttp.ClientError as exc:
        tally.add("connection error", f"{rid}: {exc!r}")
        return
    if status == 200:
        now = time.monotonic()
        tally.seconds.append(now - t0)
        tally.answered_at.append(now)
    _account(rid, status, results, tally)


async def _call(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, list[dict]]:
    async with session.post(f"{url}/generate", json=body) as resp:
        if resp.status != 200:
            return resp.status, [await resp.json(loads=orjson.loads)]
        return resp.status, await _read(resp, bool(body.get("stream")))


def _account(rid: str, status: int, results: list[dict], tally: Tally) -> None:
    if status >= 500:
        tally.add(f"rejected {status}", f"{rid}: HTTP {status}: {results}")
    elif status != 200:
        tally.add(f"rejected {status}")
    elif any("error" in r or stream_error(r) is not None for r in results):
        tally.add("stream error", f"{rid}: {results}")
    elif not results or any(r["meta_info"].get("finish_reason") is None for r in results):
        tally.add("lost", f"{rid}: an answer without a finish reason")
    else:
        kinds = {r["meta_info"]["finish_reason"]["type"] for r in results}
        tally.add("aborted" if "abort" in kinds else "finished")
        tally.tokens += sum(len(r["output_ids"]) for r in results)


@dataclass
class RssSamples:
    t0: float  # when the traffic started (monotonic)
    values: dict[str, list[int]]  # bytes, each process's samples in order
    times: dict[str, list[float]]  # seconds since t0 of each sample


async def _drive(url: str, cfg: SoakConfig, pids: dict[str, int]) -> tuple[Tally, RssSamples, float]:
    tally = Tally()
    rss = RssSamples(time.monotonic(), {name: [] for name in pids}, {name: [] for name in pids})
    deadline = time.monotonic() + cfg.minutes * 60
    counter = iter(range(10**9))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=REQUEST_TIMEOUT_S)

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            await _one(session, url, rng, f"soak-{next(counter)}", tally)

    async def sample_rss() -> None:
        while time.monotonic() < deadline:
            for name, pid in pids.items():
                if (value := rss_bytes(pid)) is not None:
                    rss.values[name].append(value)
                    rss.times[name].append(time.monotonic() - rss.t0)
            await asyncio.sleep(RSS_SAMPLE_S)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(sample_rss(), *(worker(cfg.seed * 1000 + i) for i in range(cfg.concurrency)))
    return tally, rss, time.monotonic() - rss.t0


def _quarter_means(samples: list[int]) -> list[float]:
    """Mean of each quarter of the samples, q = len // 4 each: [0, q), [q, 2q), [2q, 3q), [3q, 4q)
    (the last len % 4 samples are in none). The table, the JSON and the drift all read these."""
    q = len(samples) // 4
    return [statistics.mean(samples[i * q:(i + 1) * q]) for i in range(4)]


def _quarters(samples: list[int]) -> list[float]:
    return [round(mean / 2**20, 1) for mean in _quarter_means(samples)]


def _drift(samples: list[int]) -> float:
    """Last quarter over second. The first quarter is warm-up (a one-minute soak's scheduler by
    quarter: 653, 694, 698, 693 MB), and on a loaded CI machine warm-up alone once passed 1.25x."""
    if len(samples) < 4:
        return 1.0
    means = _quarter_means(samples)
    return means[3] / means[1]


def run(cfg: SoakConfig) -> dict[str, Any]:
    env = {"TANDEM_TEST_RETRACT": "1"}
    with start_server(cfg.server_args, env=env) as (url, proc):
        info = _get_json(f"{url}/get_server_info")
        pids = {"main": proc.pid, "scheduler": info["scheduler_pid"], "detokenizer": info["detokenizer_pid"]}
        tally, rss_samples, seconds = asyncio.run(_drive(url, cfg, pids))
        leaks = leak_check(url)
        exit_status = stop_server(proc)
    if cfg.plot:
        plot_soak(cfg.plot, tally, rss_samples)
    rss = rss_samples.values
    leftovers = [name for name, pid in pids.items() if alive(pid)] + ipc_dirs(pids["main"])
    drift = {name: round(_drift(samples), 3) for name, samples in rss.items()}
    checks = {
        "every request accounted for (no lost, hung or 5xx)": not tally.problems,
        "no leaked KV slots or rows after /flush_cache": leaks["ok"],
        f"RSS drift <= {cfg.max_rss_drift:g}x (last quarter / second quarter)": max(drift.values()) <= cfg.max_rss_drift,
        "nothing outlives the server (processes, IPC dirs)": not leftovers,
        "clean exit on SIGTERM": exit_status == 0,
    }
    return {"minutes": cfg.minutes, "seconds": round(seconds, 1), "concurrency": cfg.concurrency,
            "requests": sum(tally.outcomes.values()), "outcomes": dict(tally.outcomes), "tokens": tally.tokens,
            "problems": tally.problems[:20], "leaks": leaks, "latency_s": tally.latency(),
            "rss_mb_first_last": {n: [round(s[0] / 2**20, 1), round(s[-1] / 2**20, 1)] for n, s in rss.items() if s},
            "rss_mb_by_quarter": {n: _quarters(s) for n, s in rss.items() if len(s) >= 4},
            "rss_drift": drift, "leftovers": leftovers, "exit_status": exit_status, "checks": checks,
            "plot": cfg.plot, "ok": all(checks.values())}


def plot_soak(path: str, tally: Tally, rss: RssSamples) -> None:
    """Two panels over the run's time: each process's RSS, and each answered request's latency
    (call to answer, at the time it was answered) with the p50 and p99 of each time bin."""
    import matplotlib  # lazy: plotting is optional and matplotlib is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for name, values in rss.values.items():
        top.plot(rss.times[name], [v / 2**20 for v in values], marker=".", label=name)
    top.set(title="RSS by process", ylabel="MB")
    top.legend(loc="upper left")
    top.grid(alpha=0.3)
    when = [t - rss.t0 for t in tally.answered_at]
    bottom.scatter(when, tally.seconds, s=6, alpha=0.35, label="a request")
    if when:
        width = max(max(when) / 30, RSS_SAMPLE_S)
        bins: dict[int, list[float]] = {}
        for t, s in zip(when, tally.seconds):
            bins.setdefault(int(t // width), []).append(s)
        mids = [(b + 0.5) * width for b in sorted(bins)]
        for q, style in ((0.5, "-"), (0.99, "--")):
            picks = [sorted(v)[min(len(v) - 1, int(q * len(v)))] for _, v in sorted(bins.items())]
            bottom.plot(mids, picks, style, color="black", label=f"p{round(q * 100)} per {width:.0f} s")
    bottom.set(title="Latency of answered requests (call to answer)", xlabel="time since start (s)",
               ylabel="seconds")
    bottom.legend(loc="upper left")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return orjson.loads(resp.read())


def print_report(result: dict[str, Any]) -> None:
    print(f"\nsoak: {result['requests']} requests in {result['seconds']} s "
          f"({result['concurrency']} clients), {result['tokens']} tokens, "
          f"{result['leaks']['num_retractions']} retractions")
    print(f"{'outcome':<28}{'requests':>10}")
    for outcome, n in sorted(result["outcomes"].items(), key=lambda kv: -kv[1]):
        print(f"{outcome:<28}{n:>10}")
    if lat := result["latency_s"]:
        print(f"\nanswered requests, call to answer: p50 {lat['p50']} s, p99 {lat['p99']} s, max {lat['max']} s")
    print(f"\n{'process':<14}{'RSS first MB':>14}{'RSS last MB':>13}{'drift':>8}")
    for name, (first, last) in result["rss_mb_first_last"].items():
        print(f"{name:<14}{first:>14}{last:>13}{result['rss_drift'][name]:>8}")
    if result["plot"]:
        print(f"\nRSS and latency over time: {result['plot']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--max-rss-drift", type=float, default=1.25)
    p.add_argument("--server-args", default="--max-total-tokens 12000 --max-running-requests 16 "
                   "--enable-priority-scheduling --chunked-prefill-size 256",
                   help="passed to the launched server (forced retraction is always on)")
    p.add_argument("--output-file", default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw RSS and latency over time (matplotlib)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    return run_checked(lambda server_args: run(SoakConfig(args.minutes, args.concurrency, args.seed,
                                                          args.max_rss_drift, server_args, args.plot)),
                       print_report, "problems", args.server_args, args.model_path, args.output_file)


if __name__ == "__main__":
    sys.exit(main())

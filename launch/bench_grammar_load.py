"""`tandem bench grammar-load`: what huge grammar compiles cost everyone else.

Starts a server, times a plain 4-token greedy request and `/health_generate` idle, then again
while `--schemas` requests each compile a different `--properties`-property JSON schema (10,000
properties is about 300 KB), and reports the loaded latency over the idle one (the goal is within
1.5x) and how the schema requests ended. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from tandem.launch.managed_server import start_server

PLAIN = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}


def schema(i: int, properties: int) -> str:
    return json.dumps({"type": "object", "properties": {f"s{i}_p{k}": {"type": "string"} for k in range(properties)}})


def _timed(call) -> float:
    t0 = time.perf_counter()
    resp = call()
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    return time.perf_counter() - t0


def _plain(url: str) -> float:
    return _timed(lambda: requests.post(f"{url}/generate", json=PLAIN, timeout=120))


def _health(url: str) -> float:
    return _timed(lambda: requests.get(f"{url}/health_generate", timeout=120))


def measure(url: str, schemas: int, properties: int, window_s: float) -> dict[str, Any]:
    for _ in range(3):  # warm-up: first steps build kernels
        _plain(url)
    idle = [_plain(url) for _ in range(10)]
    idle_health = [_health(url) for _ in range(3)]
    outcomes: list[str] = []
    lock = threading.Lock()

    def constrained(i: int) -> None:
        body = {"input_ids": [11, 12], "sampling_params": {"max_new_tokens": 4, "json_schema": schema(i, properties)}}
        resp = requests.post(f"{url}/generate", json=body, timeout=300)
        message = resp.json().get("error", {}).get("message", "") if resp.status_code != 200 else ""
        kind = ("compile timeout" if "did not compile within" in message else "over --max-grammar-bytes"
                if "max-grammar-bytes" in message else f"HTTP {resp.status_code}")
        with lock:
            outcomes.append(kind)

    loaded: list[float] = []
    loaded_health: list[float] = []
    with ThreadPoolExecutor(schemas) as pool:
        futures = [pool.submit(constrained, i) for i in range(schemas)]
        time.sleep(0.5)  # every schema has arrived (a 300 KB body parses in milliseconds)
        deadline = time.monotonic() + window_s
        while time.monotonic() < deadline:
            loaded.append(_plain(url))
            if len(loaded) % 5 == 0:
                loaded_health.append(_health(url))
        for f in futures:
            f.result()
    idle_s, loaded_s = statistics.median(idle), statistics.median(loaded)
    return {"schemas": schemas, "properties": properties, "schema_bytes": len(schema(0, properties)),
            "plain_idle_s": round(idle_s, 4), "plain_loaded_median_s": round(loaded_s, 4),
            "plain_loaded_max_s": round(max(loaded), 4), "plain_loaded_over_idle": round(loaded_s / idle_s, 2),
            "health_idle_s": round(statistics.median(idle_health), 4),
            "health_loaded_max_s": round(max(loaded_health), 4) if loaded_health else None,
            "plain_requests_while_loaded": len(loaded),
            "schema_outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))}}


def print_report(label: str, r: dict[str, Any]) -> None:
    print(f"\n{label}: {r['schemas']} schemas of {r['properties']} properties ({r['schema_bytes']} bytes each)")
    print(f"{'':<34}{'idle s':>10}{'loaded s':>12}{'ratio':>8}")
    print(f"{'plain 4-token request (median)':<34}{r['plain_idle_s']:>10}{r['plain_loaded_median_s']:>12}"
          f"{r['plain_loaded_over_idle']:>8}")
    print(f"{'plain 4-token request (max)':<34}{'':>10}{r['plain_loaded_max_s']:>12}")
    print(f"{'/health_generate (max)':<34}{r['health_idle_s']:>10}{str(r['health_loaded_max_s']):>12}")
    print(f"schema requests: {r['schema_outcomes']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench grammar-load", description=__doc__.split("\n")[0])
    p.add_argument("--schemas", type=int, default=16)
    p.add_argument("--properties", type=int, default=10000)
    p.add_argument("--window", type=float, default=20.0, help="seconds of plain requests beside the compiles")
    p.add_argument("--server-args", action="append", default=None,
                   help="one configuration per use (default: the defaults, and --max-grammar-bytes 1000000 "
                        "so that the schemas compile)")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    configs = args.server_args or ["", "--max-grammar-bytes 1000000"]
    results = {}
    for server_args in configs:
        with start_server(server_args) as (url, _proc):
            results[server_args or "(defaults)"] = measure(url, args.schemas, args.properties, args.window)
    for label, r in results.items():
        print_report(label, r)
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

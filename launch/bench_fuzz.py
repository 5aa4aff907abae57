"""`tandem bench fuzz`: hypothesis-generated requests against every route of a server it starts.

Bodies are mutations of valid `/generate` bodies and arbitrary JSON: wrong types, NaN and
Infinity, numbers past int64 and float32, deep nesting, long strings, invalid UTF-8, duplicate
rids, odd content types and methods. The server must answer every one below 500; afterwards it
must still be healthy, a greedy request must give the same tokens as before the fuzzing, and
after `/flush_cache` every KV slot and request row must be free.

Prints the status histogram and writes JSON; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import Counter
from typing import Any

import requests

from tandem.launch.managed_server import leak_check, run_checked, start_server

REQUEST_TIMEOUT_S = 30.0
REFERENCE = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
ROUTES = [("POST", "/generate")] * 8 + [
    ("POST", "/abort_request"), ("POST", "/flush_cache"), ("GET", "/get_server_info"), ("GET", "/server_info"),
    ("GET", "/model_info"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/health"),
    ("GET", "/generate"), ("PUT", "/generate"), ("DELETE", "/flush_cache"), ("GET", "/flush_cache"),
    ("POST", "/does_not_exist"), ("OPTIONS", "/generate"),
]
CONTENT_TYPES = ["application/json", "application/json", "application/json", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
SAMPLING_KEYS = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                 "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "n",
                 "seed", "sampling_seed", "stream_interval", "json_schema", "regex", "skip_special_tokens", "bogus"]
TOP_KEYS = ["text", "input_ids", "rid", "stream", "return_logprob", "logprob_start_len", "top_logprobs_num",
            "token_ids_logprob", "return_text_in_logprobs", "priority", "extra_key", "return_hidden_states",
            "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64", "lora_path", "image_data", "abort_all",
            "bogus_field"]


def _strategies():
    from hypothesis import strategies as st

    nasty_numbers = st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 2**70, 1e39, -1e39, 3.41e38, 1e-300,
                                     1e-46, 0.5, float("nan"), float("inf"), float("-inf"), 10**400])
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70000), nasty_numbers,
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
                        st.sampled_from(["", "a" * 10000, "\x00", "\ud800".encode("utf-8", "surrogatepass").decode(
                            "utf-8", "replace"), "<|im_start|>", "rid-dup"]))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=5)),
                          max_leaves=20)
    small_sp = st.fixed_dictionaries({"max_new_tokens": st.integers(0, 4)},
                                     optional={k: values for k in SAMPLING_KEYS if k != "max_new_tokens"})
    sampling = st.one_of(small_sp, st.lists(small_sp, max_size=3), values)
    generate = st.fixed_dictionaries(
        {}, optional={**{k: values for k in TOP_KEYS}, "sampling_params": sampling,
                      "text": st.one_of(st.text(max_size=30), st.lists(st.text(min_size=1, max_size=10), max_size=4)),
                      "input_ids": st.one_of(st.lists(st.integers(-2, 50000), max_size=8),
                                             st.lists(st.lists(st.integers(0, 49151), max_size=4), max_size=3)),
                      "rid": st.one_of(st.text(max_size=8), st.lists(st.sampled_from(["a", "a", "b"]), max_size=3))})
    depth = st.integers(1, 1200)
    deep_objects = st.sampled_from([1024, 1025, 100_000])
    body = st.one_of(
        generate.map(lambda d: ("json", d)),
        values.map(lambda v: ("json", v)),
        depth.map(lambda n: ("raw", ("[" * n + "1" + "]" * n).encode())),
        depth.map(lambda n: ("raw", ('{"text": "a", "sampling_params": {"logit_bias": {"1": ' + "[" * n + "]" * n
                                     + "}}}").encode())),
        # objects nested past the parser's limit (orjson 3.8 died of SIGSEGV near 50,000), in the
        # body and inside a json_schema string
        deep_objects.map(lambda n: ("raw", ('{"text": "a", "x": ' + '{"a":' * n + "1" + "}" * n + "}").encode())),
        deep_objects.map(lambda n: ("json", {"text": "a", "sampling_params": {
            "max_new_tokens": 1, "json_schema": '{"a":' * n + "1" + "}" * n}})),
        st.binary(max_size=200).map(lambda b: ("raw", b)),
        st.sampled_from([b"", b"{", b"null", b"NaN", b'{"text": "\xff\xfe"}', b'{"text": NaN}',
                         b'{"text": "a", "sampling_params": {"temperature": Infinity}}']).map(lambda b: ("raw", b)),
    )
    return st.tuples(st.sampled_from(ROUTES), st.sampled_from(CONTENT_TYPES), body)


def _encode(kind: str, value: Any) -> bytes:
    if kind == "raw":
        return value
    try:
        return json.dumps(value, allow_nan=True).encode("utf-8", "surrogatepass")  # NaN/Infinity on purpose
    except (RecursionError, ValueError):
        return b"{}"


def _send(url: str, method: str, path: str, content_type: str | None, data: bytes) -> int:
    headers = {} if content_type is None else {"Content-Type": content_type}
    try:
        resp = requests.request(method, url + path, data=data, headers=headers, timeout=REQUEST_TIMEOUT_S)
        return resp.status_code
    except requests.Timeout:
        return -1  # a long but legal generation: the client gives up and the server aborts it
    except requests.RequestException:
        return -2  # the connection failed: counts as a crash


def fuzz(url: str, cases: int, seed: int) -> tuple[Counter, list[str]]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    statuses: Counter = Counter()
    bad: list[str] = []

    @hypothesis_seed(seed)
    @settings(max_examples=cases, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_strategies())
    def one(case: tuple) -> None:
        (method, path), content_type, (kind, value) = case
        data = _encode(kind, value)
        status = _send(url, method, path, content_type, data)
        statuses[status] += 1
        if status >= 500 or status == -2:
            bad.append(f"{method} {path} ({content_type}) -> {status}: {data[:200]!r}")

    one()
    return statuses, bad


def _greedy(url: str) -> list[int]:
    resp = requests.post(url + "/generate", json=REFERENCE, timeout=60)
    resp.raise_for_status()
    return resp.json()["output_ids"]


def run(cases: int, seed: int, server_args: str) -> dict[str, Any]:
    with start_server(server_args) as (url, proc):
        before = _greedy(url)
        t0 = time.monotonic()
        statuses, bad = fuzz(url, cases, seed)
        seconds = time.monotonic() - t0
        healthy = proc.poll() is None and requests.get(url + "/health", timeout=30).status_code == 200
        same = healthy and _greedy(url) == before
        no_leaks = healthy and leak_check(url)["ok"]
    checks = {"no response >= 500 and no dropped connection": not bad, "healthy afterwards": healthy,
              "greedy output unchanged": same, "no leaked KV slots or rows after /flush_cache": no_leaks}
    return {"cases": cases, "seed": seed, "seconds": round(seconds, 1),
            "statuses": {str(k): v for k, v in sorted(statuses.items())}, "server_errors": bad[:20],
            "checks": checks, "ok": all(checks.values())}


def print_report(result: dict[str, Any]) -> None:
    print(f"\nfuzz: {result['cases']} cases (seed {result['seed']}) in {result['seconds']} s")
    print(f"{'status':<10}{'responses':>10}")
    for status, n in result["statuses"].items():
        label = {"-1": "timeout", "-2": "dropped"}.get(status, status)
        print(f"{label:<10}{n:>10}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--server-args", default="--max-total-tokens 8000 --max-running-requests 16")
    p.add_argument("--output-file", default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("hypothesis") is None:
        print("error: tandem bench fuzz needs hypothesis: pip install hypothesis", file=sys.stderr)
        return 1
    return run_checked(lambda server_args: run(args.cases, args.seed, server_args), print_report, "server_errors",
                       args.server_args, args.model_path, args.output_file)


if __name__ == "__main__":
    sys.exit(main())

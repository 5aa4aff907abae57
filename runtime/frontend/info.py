"""What every front end reports about the server: the served model name, model info, server
info and the load report (HTTP routes and both gRPC services answer from these)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from tandem.runtime.frontend.loads import loads_report, scheduler_load
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.frontend.tokenizer_manager import DEFAULT_MODEL_NAME, TokenizerManager

SECRET_ARGS = frozenset({"api_key", "admin_api_key"})  # never shown by /server_info

VERSION = "0.1.0"
HEALTH_POLL_S = 0.25


def served_model_name(args: ServerArgs) -> str:
    return args.served_model_name or args.model_path or DEFAULT_MODEL_NAME


def model_info(tm: TokenizerManager) -> dict[str, Any]:
    args = tm.args
    return {"model_path": args.model_path or "SmolLM2-135M-Instruct (embedded)",
            "tokenizer_path": args.tokenizer_path or args.model_path, "is_generation": True,
            "served_model_name": served_model_name(args), "weight_version": tm.weight_version, **tm.model_info}


async def server_info(tm: TokenizerManager) -> dict[str, Any]:
    """SGLang's shape: the server arguments, the scheduler's counters, `internal_states` (one per
    scheduler, which SGLang's bench_serving reads the speculative accept length from) and
    `dp_size`, which the gateway's --dp-aware registration needs."""
    info = {k: v for k, v in vars(tm.args).items() if k != "extra" and k not in SECRET_ARGS}
    info.update(await tm.server_info())
    info["served_model_name"] = served_model_name(tm.args)
    info["dp_size"] = 1  # data parallelism is the gateway's job: one worker, one rank of it
    info["internal_states"] = [{"last_gen_throughput": info.get("gen_throughput", 0.0),
                                **({"avg_spec_accept_length": info["avg_spec_accept_length"]}
                                   if "avg_spec_accept_length" in info else {})}]
    info["version"] = VERSION
    info["weight_version"] = tm.weight_version
    return info


async def current_loads(tm: TokenizerManager, include: set[str] | None = None) -> dict[str, Any]:
    """SGLang's load report (what the gateway polls), from the scheduler's current counters."""
    load = scheduler_load(await tm.server_info(), tm.args.max_running_requests, tm.metrics.prefix_hit_rate)
    return loads_report(load, VERSION, include)


async def health_generate(tm: TokenizerManager, timeout_s: float) -> None:
    """A one-token generation through every process; raises when the server shows no progress
    within `timeout_s`. A busy server gets to the probe late, or refuses it (a full queue), so,
    as SGLang's health check counts any output after it started, progress is also an output
    reaching this process, or a step the scheduler completed after the probe started while every
    output it has sent reached this process (a hung detokenizer is no progress: the probe's own
    step would count otherwise)."""
    started = time.monotonic()
    deadline = started + timeout_s
    # each control call waits as long as the probe has left, not the control default (10 s): the
    # probe's own deadline answers, so --health-generate-timeout holds however long it is
    steps = (await asyncio.wait_for(tm.server_info(timeout_s + 1), timeout_s))["num_steps"]
    body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "rid": f"health-{time.monotonic_ns()}"}
    probe = asyncio.ensure_future(tm.generate(body, log_metrics=False))  # probes stay out of /metrics, as SGLang's
    try:
        while tm.last_output_at <= started:
            if probe.done() and (probe.exception() is None or tm.dead_reason):
                probe.result()  # finished: healthy; a dead server's error: raised
                return
            left = deadline - time.monotonic()
            if left <= 0:
                if probe.done():
                    probe.result()  # its own error (the queue is full and nothing moves)
                raise asyncio.TimeoutError
            if probe.done():
                await asyncio.sleep(min(left, HEALTH_POLL_S))
            else:
                await asyncio.wait({probe}, timeout=min(left, HEALTH_POLL_S))
            left = max(deadline - time.monotonic(), 0.001)
            info = await asyncio.wait_for(tm.server_info(left + 1), left)
            if info["num_steps"] > steps and tm.num_outputs >= info["num_outputs_sent"]:
                return
    finally:
        probe.cancel()  # a probe still waiting is aborted by its call's cleanup

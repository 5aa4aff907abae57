"""What every front end reports about the server: the served model name, model info, server
info and the load report (HTTP routes and both gRPC services answer from these)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from tandem.runtime.server.auth import SECRET_ARGS
from tandem.runtime.server.loads import loads_report, scheduler_load
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.tokenizer_manager import DEFAULT_MODEL_NAME, TokenizerManager

VERSION = "0.1.0"


def served_model_name(args: ServerArgs) -> str:
    return args.served_model_name or args.model_path or DEFAULT_MODEL_NAME


def model_info(tm: TokenizerManager) -> dict[str, Any]:
    args = tm.args
    return {"model_path": args.model_path or "SmolLM2-135M-Instruct (embedded)",
            "tokenizer_path": args.tokenizer_path or args.model_path, "is_generation": True,
            "served_model_name": served_model_name(args), **tm.model_info}


async def server_info(tm: TokenizerManager) -> dict[str, Any]:
    info = {k: v for k, v in vars(tm.args).items() if k != "extra" and k not in SECRET_ARGS}
    info.update(await tm.server_info())
    info["version"] = VERSION
    return info


async def current_loads(tm: TokenizerManager, include: set[str] | None = None) -> dict[str, Any]:
    """SGLang's load report (what the gateway polls), from the scheduler's current counters."""
    load = scheduler_load(await tm.server_info(), tm.args.max_running_requests, tm.metrics.prefix_hit_rate)
    return loads_report(load, VERSION, include)


async def health_generate(tm: TokenizerManager, timeout_s: float) -> None:
    """A one-token generation through every process; raises when it fails or takes too long."""
    body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "rid": f"health-{time.monotonic_ns()}"}
    await asyncio.wait_for(tm.generate(body), timeout_s)

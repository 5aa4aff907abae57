"""SGLang's launch flags that tandem takes without a ServerArgs field, so that an SGLang launch
command (a benchmark harness's, a deployment script's) starts tandem unchanged; also tandem's own
retired flags. On the CLI, and as `Engine(**kwargs)` keywords (SGLang's Engine takes its
ServerArgs fields so); a TOML preset names ServerArgs fields.

Each accepted flag cannot change an answer here: tandem captures no CUDA graphs and compiles
nothing, runs no code from the checkpoint, always serves /metrics and cached-token counts, and
has one data/expert/pipeline rank. They are logged as ignored, with the reason. SGLang's flags
that would change answers (quantized weights, LoRA adapters) are taken by the parser only to be
refused with the reason, naming the flag.
"""
from __future__ import annotations

import argparse
from typing import Any

# flag -> (takes a value, why it changes nothing on tandem)
IGNORED: dict[str, tuple[bool, str]] = {
    "--disable-cuda-graph": (False, "tandem captures no CUDA graphs"),
    "--cuda-graph-max-bs": (True, "tandem captures no CUDA graphs"),
    "--enable-torch-compile": (False, "tandem does not torch.compile its model"),
    "--torch-compile-max-bs": (True, "tandem does not torch.compile its model"),
    "--trust-remote-code": (False, "tandem runs no code from a checkpoint (its own model classes and tokenizer)"),
    "--enable-metrics": (False, "/metrics is always served"),
    "--enable-cache-report": (False, "usage.prompt_tokens_details.cached_tokens is always reported"),
    "--skip-server-warmup": (False, "tandem sends no warm-up request"),
    "--disable-custom-all-reduce": (False, "tensor parallelism uses torch.distributed's all-reduce"),
    "--enable-p2p-check": (False, "tensor parallelism uses torch.distributed"),
    "--decode-log-interval": (True, "tandem logs decode batches at its own interval"),
    "--enable-fp32-lm-head": (False, "tandem's LM head always computes fp32 logits (fp32 sums over the hidden state)"),
    "--priority-preemption": (False, "tandem's old flag: preemption is now the default with priority scheduling"),
}
# flag -> (takes a value, why tandem refuses it): serving without it would answer differently
REFUSED: dict[str, tuple[bool, str]] = {
    "--quantization": (True, "tandem serves the checkpoint's weights in --dtype (a GGUF file dequantized); "
                             "it has no quantized kernels"),
    "--lora-paths": (True, "tandem serves no LoRA adapters"),
    "--enable-lora": (False, "tandem serves no LoRA adapters"),
}
# SGLang's parallelism flags for what tandem runs as one rank: accepted at 1, refused above
SINGLE_RANK = {"dp_size": ("--dp-size", "--dp", "--data-parallel-size"),
               "ep_size": ("--ep-size", "--ep", "--expert-parallel-size"),
               "pp_size": ("--pp-size", "--pipeline-parallel-size")}


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SGLang flags that change nothing here (accepted and logged)")
    for flag, (takes_value, _) in IGNORED.items():
        if takes_value:
            group.add_argument(flag, default=None, dest=_dest(flag))
        else:
            group.add_argument(flag, action="store_true", default=None, dest=_dest(flag))
    for dest, flags in SINGLE_RANK.items():
        group.add_argument(*flags, type=int, default=None, dest=dest)
    refused = parser.add_argument_group("SGLang flags that would change answers (refused, with the reason)")
    for flag, (takes_value, _) in REFUSED.items():
        kind = {"nargs": "*"} if takes_value else {"action": "store_true"}
        refused.add_argument(flag, default=None, dest=_dest(flag), help=argparse.SUPPRESS, **kind)


def check(ns: argparse.Namespace) -> list[str]:
    """Refuses a flag that would change answers and a parallelism flag above 1 (ValueError naming
    it); returns the ignored flags' log lines."""
    for flag, (_, why) in REFUSED.items():
        if getattr(ns, _dest(flag), None) is not None:
            raise ValueError(f"{flag}: {why}")
    for dest, flags in SINGLE_RANK.items():
        value: Any = getattr(ns, dest, None)
        if value is not None and value != 1:
            why = "; data parallelism is the gateway's job (smg --dp-aware)" if dest == "dp_size" else ""
            raise ValueError(f"{flags[0]}: tandem runs one rank of it, got {value}{why}")
    return [f"{flag} ignored: {why}" for flag, (_, why) in IGNORED.items() if getattr(ns, _dest(flag), None)]


def engine_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`Engine(**kwargs)`: the ServerArgs keywords, and the log lines of the flags above given
    by their keyword names (`disable_cuda_graph=True`); a parallelism size above 1 is refused."""
    keywords = {flag.removeprefix("--").replace("-", "_"): flag for flag in IGNORED}
    ns = argparse.Namespace(**{_dest(keywords[k]): v for k, v in kwargs.items() if k in keywords},
                            **{k: v for k, v in kwargs.items() if k in SINGLE_RANK})
    rest = {k: v for k, v in kwargs.items() if k not in keywords and k not in SINGLE_RANK}
    return rest, check(ns)


def _dest(flag: str) -> str:
    return "sglang_" + flag.removeprefix("--").replace("-", "_")

"""The one typed registry of TANDEM_* environment switches (and the one reader of Triton's
TRITON_INTERPRET, which tandem checks in two places)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T", bool, int, float, str)


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        kind = type(self.default)
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")  # type: ignore[return-value]
        try:
            return kind(raw)  # type: ignore[return-value]
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is not a valid {kind.__name__}") from exc


class Envs:
    TEST_RETRACT = EnvVar("TANDEM_TEST_RETRACT", False, "force a retraction every N decode steps (tests)")
    TEST_RETRACT_INTERVAL = EnvVar("TANDEM_TEST_RETRACT_INTERVAL", 3, "N for TANDEM_TEST_RETRACT")
    DEBUG_FUTURE_MAP = EnvVar("TANDEM_DEBUG_FUTURE_MAP", False, "poison the future map and check every gather")
    FORCE_STREAM_INTERVAL = EnvVar("TANDEM_FORCE_STREAM_INTERVAL", 50, "internal stream interval of non-streaming logprob requests")
    CACHE_DIR = EnvVar("TANDEM_CACHE_DIR", "", "where converted tokenizers are cached (default ~/.cache/tandem)")
    CHILD_WATCH_INTERVAL = EnvVar("TANDEM_CHILD_WATCH_INTERVAL", 0.5, "seconds between child-process liveness checks")
    CPU_PACK_WEIGHTS = EnvVar("TANDEM_CPU_PACK_WEIGHTS", True, "linears on packed weights on CPU: bf16 "
                              "in oneDNN's layout (native bf16 CPUs), fp32 in MKL's or oneDNN's, whichever measures faster "
                              "(0: torch's plain linear, for A/B runs)")
    CPU_AMX_LINEAR = EnvVar("TANDEM_CPU_AMX_LINEAR", True, "bf16 linears on CPUs with AMX run tandem's "
                            "batch-invariant AMX kernel (kernels/csrc/amx_linear_cpu.cpp; 0: oneDNN's, whose "
                            "results change with the row count, for A/B runs)")
    CPU_DECODE_STEP = EnvVar("TANDEM_CPU_DECODE_STEP", True, "with the cpu attention backend, a decode step's "
                             "layers run in one C++ call (runtime/model/cpu_decode_step.py; 0: the Python modules, "
                             "for A/B runs)")
    GGUF_QUANTIZED = EnvVar("TANDEM_GGUF_QUANTIZED", True, "--quantization unset (or auto) serves a GGUF "
                            "file's quantized tensors as stored on CPU (runtime/model/quant/; 0: dequantized "
                            "to --dtype, as --quantization none)")
    CPU_MALLOC_KEEP = EnvVar("TANDEM_CPU_MALLOC_KEEP", True, "CPU model processes keep freed large blocks in "
                             "glibc's heap instead of unmapping them (0: glibc's defaults, for A/B runs)")
    CPU_SHARE = EnvVar("TANDEM_CPU_SHARE", True, "on CPU, the forward runs one intra-op thread fewer for every "
                       "core other processes keep busy (runtime/scheduler/cpu_share.py; 0: always every thread)")
    TEST_FORWARD_HANG = EnvVar("TANDEM_TEST_FORWARD_HANG", 0.0, "seconds every forward step sleeps first (watchdog tests)")
    STRICT_MEM_CHECK = EnvVar("TANDEM_STRICT_MEM_CHECK", False, "a scheduler that goes idle holding KV slots or "
                              "request rows raises (tests; as SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE); off: it logs an error")
    RETURN_ORIGINAL_LOGPROB = EnvVar("TANDEM_RETURN_ORIGINAL_LOGPROB", False, "output logprobs before temperature "
                                     "scaling (still after penalties, logit bias and the grammar mask), as "
                                     "SGLANG_RETURN_ORIGINAL_LOGPROB")


envs = Envs

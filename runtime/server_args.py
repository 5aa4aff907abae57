"""ServerArgs: one frozen dataclass built from CLI flags, a TOML preset, or keyword arguments."""
from __future__ import annotations

import argparse
import re
import ctypes
import dataclasses
import functools
import json
import os
import tomllib
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tandem.kernels.interpreter import triton_interpreting
from tandem.runtime.reasoning import PARSERS
from tandem.runtime.tools import TOOL_CALL_PARSERS

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.toml"


# auto: the model dtype; fp8: one byte per element, no scales (runner.py maps them to torch dtypes)
KV_CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3")
# --quantization values served (runtime/model/quant/gguf_load.py, gptq_awq.py); SGLang's others are refused naming these
QUANTIZATIONS = (None, "auto", "gguf", "gptq", "awq", "w8a8_int8", "none")
# SGLang's other spellings of a value, taken as tandem's
_VALUE_ALIASES = {"dtype": {"half": "float16", "float": "float32"}, "attention_backend": {"torch_native": "torch"}}
_CHOICES = {
    "schedule_policy": ("fcfs", "lpm"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "attention_backend": ("auto", "torch", "cpu", "triton"),
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "model_impl": ("auto", "sglang", "transformers"),
    "grammar_backend": ("xgrammar", "none"),
    "reasoning_parser": (None, *PARSERS),
    "tool_call_parser": (None, *TOOL_CALL_PARSERS),
    "sampling_defaults": ("model", "openai"),
    "log_level": ("debug", "info", "warning", "error", "critical"),
    "log_requests_level": (0, 1, 2, 3),
}

@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    tokenizer_path: str | None = None  # a tokenizer folder or file; None = the model's
    host: str = "127.0.0.1"  # the address the HTTP server binds
    port: int = 30000  # the HTTP port
    tp_size: int = 1  # tensor-parallel ranks, one scheduler process each (all nodes together)
    nnodes: int = 1  # machines the tp ranks span: tp_size / nnodes ranks on each
    node_rank: int = 0  # this machine's index; node 0 runs the HTTP server, tokenizer and detokenizer too
    dist_init_addr: str | None = None  # HOST:PORT of torch.distributed's rendezvous (node 0); needed with nnodes > 1
    # seconds torch.distributed waits for the ranks (its join and collectives); None: torch's 30 min
    dist_timeout: int | None = None
    dtype: str = "auto"  # auto = bfloat16 on GPU and on CPUs with AMX-BF16, float32 on other CPUs
    device: str = "auto"  # auto = cuda when available
    attention_backend: str = "auto"  # auto = triton on CUDA, cpu (torch + the paged decode op) on CPU
    kv_cache_dtype: str = "auto"  # the KV pool's element: auto = the model dtype; fp8: one byte, no scales
    # SGLang's: gguf = a GGUF file's quantized tensors served as stored (CPU); gptq/awq = an int4 checkpoint's
    # linears served on the GGUF int4 kernels (CPU); w8a8_int8 = int8 weights, per-token int8 activations (CPU); none =
    # weights dequantized to --dtype; None/auto = gguf for a GGUF file on CPU (unless TANDEM_GGUF_QUANTIZED=0),
    # gptq/awq/w8a8_int8 where config.json's quantization_config says so, none otherwise
    quantization: str | None = None
    # SGLang's: sglang = tandem's own model classes only; transformers = transformers' modeling code with
    # tandem's paged KV and attention (any causal LM it can build, attention-only); auto = tandem's class where
    # there is one, transformers' otherwise
    model_impl: str = "auto"
    max_total_tokens: int | None = None  # KV cache slots (tokens); None = --mem-fraction-static of the free memory
    # the share of free memory the KV pool takes without --max-total-tokens; None = 0.1 of the host's on CPU, 0.85 of a
    # GPU's
    mem_fraction_static: float | None = None
    max_running_requests: int = 128  # requests decoding at once
    # waiting requests at most; past it a new one gets a 503 (under priority scheduling it may displace a less urgent
    # one); None = no cap
    max_queued_requests: int | None = None
    max_prefill_tokens: int = 8192  # prompt tokens one prefill step takes at most
    # new tokens of one prefill step, all its prompts together (a longer prompt continues in the next step); -1 = no
    # chunking
    chunked_prefill_size: int = 2048
    context_length: int | None = None  # the longest prompt + output; None = the model's
    allow_auto_truncate: bool = False  # SGLang's: a prompt past the context keeps its head, an output too long is cut
    schedule_policy: str = "fcfs"  # which waiting request goes first: fcfs (arrival) or lpm (longest cached prefix)
    # SGLang's: a request's `priority` orders the queue; urgent arrivals preempt
    enable_priority_scheduling: bool = False
    disable_priority_preemption: bool = False  # SGLang's: with priority scheduling, urgent arrivals preempt unless set
    schedule_low_priority_values_first: bool = False  # SGLang's: smaller priority values run first
    priority_scheduling_preemption_threshold: int = 10  # SGLang's: preempt only above this priority gap
    # SGLang's: without priority scheduling, a request that names a priority gets a 503 (it is
    # ignored otherwise)
    abort_on_priority_when_disabled: bool = False
    # SGLang's: under priority scheduling, the priority of a request that names none (None: the
    # least urgent value); ignored without priority scheduling
    default_priority_value: int | None = None
    disable_radix_cache: bool = False  # no prefix caching: every prompt is prefilled whole
    # SGLang's. tandem is deterministic without it on the cpu backend; on the triton backend it
    # makes extend cache- and chunk-invariant too (each new token a decode query: slower prefill)
    enable_deterministic_inference: bool = False
    disable_overlap_schedule: bool = False  # plan the next batch only after the device finishes this one
    request_timeout: float | None = None  # seconds a request may wait for admission before a 503; None = no limit
    max_request_bytes: int = 64 * 1024 * 1024  # an HTTP body or gRPC message larger than this is refused
    max_batch_items: int = 4096  # prompts x n in one /generate call
    max_top_logprobs_num: int = 20  # top_logprobs_num (and token_ids_logprob's length) at most
    health_generate_timeout: float = 20.0  # seconds /health_generate waits for its 1-token probe
    watchdog_timeout: float = 300.0  # <= 0: off
    graceful_shutdown_timeout: float = 30.0  # SIGTERM: running requests get this long to finish
    http_read_timeout: float = 30.0  # a request head, and a request body, must arrive within this
    max_connections: int = 1024  # concurrent connections/requests; beyond it HTTP 503
    api_key: str | None = None  # Bearer token for every route but /health* and /metrics (SGLang's)
    admin_api_key: str | None = None  # Bearer token for /flush_cache and abort_all
    enable_docs: bool = False  # serve /docs and /openapi.json
    grammar_backend: str = "xgrammar"  # guided decoding: xgrammar | none
    grammar_compile_timeout: float = 30.0  # a grammar not compiled by then: the request gets a 400
    grammar_compile_threads: int = 1  # compiles at once, on threads at the lowest OS priority
    max_grammar_bytes: int = 131072  # a json_schema / regex / ebnf / structural_tag longer than this: a 400
    constrained_json_disable_any_whitespace: bool = False  # JSON schemas: no free whitespace, ", " and ": "
    speculative_algorithm: str | None = None  # NGRAM | STANDALONE; None: plain decoding
    speculative_num_draft_tokens: int = 4  # tokens one verify checks per request: the last token + drafts
    speculative_num_steps: int | None = None  # STANDALONE: draft steps = num_draft_tokens - 1 (a chain)
    speculative_draft_model_path: str | None = None  # STANDALONE: same tokenizer, its own KV pool
    speculative_disable_batch_size: int | None = None  # more running requests than this: decode plainly
    speculative_ngram_min_match_window_size: int = 1  # NGRAM: the shortest suffix looked up in the context
    speculative_ngram_max_match_window_size: int = 12  # NGRAM: the longest suffix looked up in the context
    grpc_port: int | None = None  # serve SGLang's gRPC service and the gateway's scheduler service here
    chat_template: str | None = None  # a Jinja file overriding the tokenizer's chat template (OpenAI chat)
    # SGLang's: a JSON object of chat_template_kwargs every chat request gets unless it sets them itself
    # (e.g. '{"enable_thinking": false}')
    default_chat_template_kwargs: str | None = None
    reasoning_parser: str | None = None  # deepseek-r1 | qwen3: chat answers carry reasoning_content
    # SGLang's names: chat answers carry the model's calls in that format as tool_calls (qwen25, qwen and hermes:
    # <tool_call> JSON; llama3; mistral; pythonic; deepseekv3); None: a required or named call is a JSON array
    tool_call_parser: str | None = None
    # model: OpenAI chat takes generation_config.json's sampling for fields it omits; openai: the API's
    sampling_defaults: str = "model"
    enable_strict_thinking: bool = False  # allow max_thinking_tokens (a forced end of the reasoning)
    # a stream sends every k-th token (the first at once); a request's own stream_interval wins
    stream_interval: int = 1
    # SGLang's: each streamed /generate (and Engine) chunk carries only the text, output_ids and output
    # logprobs new since the previous one; off, chunks are cumulative. OpenAI streams are deltas either way.
    incremental_streaming_output: bool = False
    # SGLang's: OpenAI streams end with a usage chunk even when stream_options does not ask for one
    stream_response_default_include_usage: bool = False
    log_level: str = "info"  # the server's log level
    log_requests: bool = False  # SGLang's: a log line per finished request, at --log-requests-level
    # SGLang's: 0 and 1 what it was and how it ended, 2 also its output cut at 2048 chars, 3 its whole output
    log_requests_level: int = 2
    random_seed: int | None = None  # None: drawn once per launch (launcher.resolve_random_seed), as SGLang's
    served_model_name: str | None = None  # the name /v1/models and /model_info report; None = the model path
    # SGLang's: the version of the served weights in meta_info, /server_info and /model_info; a
    # weight update that names a weight_version replaces it
    weight_version: str = "default"
    # SGLang's: serve the model as an embedder (/v1/embeddings, /encode: pooled hidden states of a
    # prefill-only pass, as the model folder's sentence-transformers modules say); generation is refused
    is_embedding: bool = False

    def __post_init__(self) -> None:
        self._check_field_types()
        for name, aliases in _VALUE_ALIASES.items():
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, aliases.get(value, value))
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                shown = ", ".join("none" if a is None else str(a) for a in allowed)
                raise ValueError(f"{_flag(name)}: {getattr(self, name)!r} is not one of {shown}")
        checks = {
            "chunked_prefill_size": self.chunked_prefill_size > 0 or self.chunked_prefill_size == -1,
            "mem_fraction_static": self.mem_fraction_static is None or 0 < self.mem_fraction_static <= 1,
            "context_length": self.context_length is None or self.context_length >= 1,
            "max_total_tokens": self.max_total_tokens is None or self.max_total_tokens >= 1,
            "port": 0 <= self.port < 65536,  # 0: any free port
            "max_running_requests": self.max_running_requests > 0,
            "max_prefill_tokens": self.max_prefill_tokens >= 1,  # 0 admits no prompt: a healthy server serving nothing
            "max_connections": self.max_connections >= 1,  # 0: uvicorn refuses every connection
            "tp_size": self.tp_size >= 1,
            "nnodes": self.nnodes >= 1,
            "node_rank": 0 <= self.node_rank < self.nnodes,
            "dist_timeout": self.dist_timeout is None or self.dist_timeout > 0,
            "dist_init_addr": self.dist_init_addr is None or _is_port(self.dist_init_addr.rpartition(":")[2]),
            "max_batch_items": self.max_batch_items >= 1,
            "max_top_logprobs_num": self.max_top_logprobs_num >= 0,
            "default_priority_value": self.default_priority_value is None or -(1 << 63) <= self.default_priority_value < 1 << 63,
            # seconds: NaN compares false everywhere, so these refuse it too
            "request_timeout": self.request_timeout is None or self.request_timeout > 0,
            "health_generate_timeout": self.health_generate_timeout > 0,
            "watchdog_timeout": self.watchdog_timeout == self.watchdog_timeout,  # <= 0 is "off"
            "graceful_shutdown_timeout": self.graceful_shutdown_timeout >= 0,
            "http_read_timeout": self.http_read_timeout > 0,
            "grammar_compile_timeout": self.grammar_compile_timeout > 0,
            "grammar_compile_threads": self.grammar_compile_threads >= 1,
            "max_grammar_bytes": self.max_grammar_bytes >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"{_flag(bad[0])}: invalid value {getattr(self, bad[0])!r}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}: "
                             f"every node runs tp_size / nnodes ranks")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--dist-init-addr (HOST:PORT on node 0) is needed with --nnodes > 1")
        if self.default_chat_template_kwargs is not None:
            _check_template_kwargs(self.default_chat_template_kwargs)
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template: {self.chat_template!r} is not a Jinja template file "
                             f"(SGLang's built-in conversation template names are not served here)")
        self._check_speculative()
        self._check_triton()
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization: {self.quantization!r} is not served; tandem serves gguf (a GGUF "
                             f"file's Q4_0, Q4_1 and Q8_0 tensors kept quantized, on CPU), gptq, awq (int4) and "
                             f"w8a8_int8 checkpoints (detected from config.json's quantization_config, on CPU) "
                             f"and none (weights dequantized to --dtype, the default)")

    def _check_field_types(self) -> None:
        """A Python caller's (Engine(**kwargs)) value of the wrong type is a ValueError naming the
        flag here, not a TypeError from deep inside a check or the model load; a path object
        where a path string goes is taken as its string."""
        hints = _field_hints()
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, os.PathLike) and _has_type("", hints[f.name]):
                object.__setattr__(self, f.name, value := os.fspath(value))
            if (mismatch := _type_mismatch(value, hints[f.name])) is not None:
                raise ValueError(f"{_flag(f.name)}: {mismatch} {value!r}")

    def _check_triton(self) -> None:
        """Triton's kernels need CUDA tensors (or its CPU interpreter): refused now rather than by
        the first request, which would kill the scheduler."""
        if self.attention_backend != "triton" or triton_interpreting():
            return
        if self.device.startswith("cuda") or (self.device == "auto" and cuda_available()):
            return
        raise ValueError(f"--attention-backend triton needs a CUDA device (--device {self.device}"
                         f"{'' if self.device != 'auto' else ': none found'}), or TRITON_INTERPRET=1 to run it on CPU")

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            return
        if self.tp_size > 1:
            raise ValueError(f"--speculative-algorithm {algo} is not available with --tp-size {self.tp_size} (use 1)")
        if algo not in ("NGRAM", "STANDALONE"):
            raise ValueError(f"--speculative-algorithm: invalid value {algo!r} (NGRAM or STANDALONE)")
        if (algo == "STANDALONE") != bool(self.speculative_draft_model_path):
            raise ValueError("--speculative-draft-model-path is needed by, and only by, --speculative-algorithm STANDALONE")
        steps = self.speculative_num_steps
        if steps is not None and steps != self.speculative_num_draft_tokens - 1:
            raise ValueError(f"--speculative-num-steps {steps} must be --speculative-num-draft-tokens - 1 = "
                             f"{self.speculative_num_draft_tokens - 1}: drafts form one chain")
        if self.speculative_num_draft_tokens < 2:
            raise ValueError(f"--speculative-num-draft-tokens: invalid value "
                             f"{self.speculative_num_draft_tokens} (at least 2: the last token and one draft)")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError(f"--speculative-ngram-min-match-window-size: invalid value {lo} "
                             f"(1 <= min <= --speculative-ngram-max-match-window-size {hi})")
        limit = self.speculative_disable_batch_size
        if limit is not None and limit < 0:
            raise ValueError(f"--speculative-disable-batch-size: invalid value {limit} (>= 0)")

    # -- resolved views -------------------------------------------------------------------------
    @property
    def chat_template_defaults(self) -> dict[str, Any]:
        """--default-chat-template-kwargs as a dict (checked at start)."""
        return json.loads(self.default_chat_template_kwargs) if self.default_chat_template_kwargs else {}

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        # on CPU the runner decides by measuring (gemm_bound.pick_cpu_dtype); this is the no-probe answer
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "cpu" if self.resolved_device() == "cpu" else "triton"

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    # -- construction ---------------------------------------------------------------------------
    @staticmethod
    def from_toml(path: str | Path, **overrides: Any) -> "ServerArgs":
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"--config {str(path)!r}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {str(path)!r} is not valid TOML: {exc}") from None
        unknown = sorted(k for k, v in data.items() if isinstance(v, dict) and k not in _TOML_TABLES)
        if unknown:
            raise ValueError(f"--config {str(path)!r}: unknown table(s) {', '.join(f'[{k}]' for k in unknown)} "
                             f"(the tables are {', '.join(f'[{t}]' for t in _TOML_TABLES)})")
        flat = {**data.get("model", {}), **data.get("server", {}), **{k: v for k, v in data.items() if not isinstance(v, dict)}}
        _check_types(flat)  # TOML has its own types: "false" is a string, 1.5 a float
        return ServerArgs.from_dict({**flat, **overrides})

    @staticmethod
    def from_dict(values: dict[str, Any]) -> "ServerArgs":
        names = {f.name for f in fields(ServerArgs)}
        unknown = sorted(k for k in values if k.replace("-", "_") not in names)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return ServerArgs(**{k.replace("-", "_"): v for k, v in values.items()})

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field, SGLang's spellings of the common ones (--model, --tp, ...) too, and
        SGLang's flags that change nothing here (sglang_flags.py)."""
        from tandem.runtime import sglang_flags

        parser.add_argument("--config", type=str, default=None, help="TOML preset (flags given here override it)")
        helps = field_help()
        for f in fields(ServerArgs):
            flags = [_flag(f.name), *_FLAG_ALIASES.get(f.name, ())]
            if f.type in ("bool", bool):
                parser.add_argument(*flags, action="store_true", default=None, dest=f.name, help=helps[f.name])
            else:
                parser.add_argument(*flags, type=_cli_type(f.type), default=None, dest=f.name, help=helps[f.name],
                                    metavar=f.name.upper())
        sglang_flags.add_args(parser)

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> "ServerArgs":
        given = {f.name: getattr(ns, f.name) for f in fields(ServerArgs)
                 if getattr(ns, f.name, None) is not None}
        if getattr(ns, "config", None):
            return ServerArgs.from_toml(ns.config, **given)
        return ServerArgs(**given)


# SGLang's other names for tandem's flags (explicit: a prefix that argparse would match today
# becomes ambiguous once another flag shares it)
_FLAG_ALIASES = {"model_path": ("--model",), "tp_size": ("--tp", "--tensor-parallel-size"),
                 "speculative_draft_model_path": ("--speculative-draft-model",)}


_TOML_TABLES = ("model", "server")


def _check_types(values: dict[str, Any]) -> None:
    """Each value has its field's type (a bool is no int, and "false" no bool): a ValueError
    naming the key, the value and the type."""
    hints = _field_hints()
    for key, value in values.items():
        hint = hints.get(key.replace("-", "_"))
        if hint is not None and (mismatch := _type_mismatch(value, hint)) is not None:
            raise ValueError(f"{key} = {value!r}: {mismatch}")


@functools.cache
def _field_hints() -> dict[str, Any]:
    return typing.get_type_hints(ServerArgs)


def _type_mismatch(value: Any, hint: Any) -> str | None:
    """None when `value` has the type `hint` names, else "expected <hint>, got <its type>"."""
    if _has_type(value, hint):
        return None
    shown = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
    return f"expected {shown}, got {type(value).__name__}"


def _has_type(value: Any, hint: Any) -> bool:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_has_type(value, arg) for arg in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint  # dict[str, Any] -> dict
    if hint is type(None):
        return value is None
    if hint is float:  # an int is a float too (TOML writes 30 for 30.0)
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return hint is Any or isinstance(value, hint)


def cuda_available() -> bool:
    """torch.cuda.is_available() without importing torch (the main process stays torch-free):
    the CUDA driver initializes and sees a device (CUDA_VISIBLE_DEVICES applies)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return libcuda.cuInit(0) == 0 and libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def field_help() -> dict[str, str]:
    """Each field's --help line: the comment written at the field (beside it, or on the lines just
    above it), then its default and its choices, so the one ServerArgs definition documents the CLI."""
    comments = _field_comments()
    out = {}
    for f in fields(ServerArgs):
        default = "off" if f.default is False else f.default
        tail = f"default: {default}"
        if f.name in _CHOICES:
            tail += "; one of " + ", ".join(str(c) for c in _CHOICES[f.name])
        text = comments.get(f.name, "")
        out[f.name] = (f"{text} ({tail})" if text else tail).replace("%", "%%")
    return out


def _field_comments() -> dict[str, str]:
    import inspect

    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(ServerArgs).splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        match = re.match(r"\s{4}(\w+):[^#]*(?:#\s*(.*))?$", line)
        if match and not stripped.startswith(("def ", "@")):
            comments[match.group(1)] = " ".join([*above, match.group(2) or ""]).strip()
        above = []
    return comments


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_template_kwargs(text: str) -> None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--default-chat-template-kwargs: {text!r} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--default-chat-template-kwargs: {text!r} is not a JSON object")


def _cli_type(type_name: Any):
    text = str(type_name)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _is_port(text: str) -> bool:
    """A port torch.distributed can rendezvous on: it refuses 0 and past 65535 only once the ranks start."""
    return text.isdigit() and 0 < int(text) < 65536

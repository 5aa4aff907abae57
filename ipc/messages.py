"""Every message that crosses a process boundary, as tagged msgspec structs.

Each message is a ``msgspec.Struct`` with ``tag=True`` (the class name is the union tag),
``kw_only=True`` and ``gc=False`` (inherited from ``_Msg``). ``omit_defaults=True`` keeps
per-step outputs small: fields left at their default (e.g. empty logprob lists) are not sent.

Array fields are annotated ``np.ndarray`` and travel as raw little-endian buffers through the
codec's msgpack extension (see ``tandem.ipc.codec``). The aliases below only document the
expected dtype/rank; the sender is responsible for producing that dtype. Decoded arrays are
read-only views of the receive buffer: copy before mutating.

Batch outputs are column-wise: every per-request list is aligned with ``rids``. The optional
columns (logprobs, hidden states) are either empty (no request in this batch asked for them)
or aligned with ``rids`` with ``None`` for requests that have nothing new.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

from tandem.ipc.sampling_params import SamplingParams

__all__ = [
    "FinishReason",
    "DetokenizeParams",
    "LogprobParams",
    "LogprobArrays",
    "TokenizedGenerateReq",
    "AbortReq",
    "BatchTokenIDOutput",
    "BatchStrOutput",
    "FlushCacheReq",
    "FlushCacheReply",
    "GetServerInfoReq",
    "GetServerInfoReply",
    "WeightsReq",
    "ControlReply",
    "PauseReq",
    "ReadyMsg",
    "ChildError",
    "Message",
    "MESSAGE_TYPES",
]

# Documentation aliases: msgspec sees plain np.ndarray.
I32Array = np.ndarray  # 1-D '<i4'
F32Array = np.ndarray  # 1-D '<f4'
I32Array2D = np.ndarray  # 2-D '<i4', shape (num_tokens, k)
F32Array2D = np.ndarray  # 2-D '<f4', shape (num_tokens, k)


class _Msg(msgspec.Struct, tag=True, kw_only=True, gc=False, omit_defaults=True):
    """Base of all IPC messages; never sent itself.

    msgspec inherits tag/gc/omit_defaults but not kw_only (it applies to the fields a class
    defines), so every subclass repeats ``kw_only=True``.
    """


class FinishReason(msgspec.Struct, kw_only=True, gc=False, omit_defaults=True):
    """Why a request finished. Untagged: it only ever appears nested in a message.

    type is "stop" | "length" | "abort"; ``matched`` is the stop token id or stop string.
    A 400 the scheduler decides names the request ``field`` it is about by its native name
    (``sampling_params.regex``), so each surface can name it as its client sent it; SGLang's
    JSON carries it only as the start of the message.
    """

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None
    field: str | None = None

    @classmethod
    def bad_request(cls, field: str, message: str) -> "FinishReason":
        return cls(type="abort", status_code=400, err_type="BadRequest", field=field, message=message)

    def to_json(self) -> dict[str, Any]:
        """The SGLang ``meta_info.finish_reason`` shape for this reason."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {
            "type": self.type,
            "message": f"{self.field} {self.message}" if self.field else self.message,
            "status_code": self.status_code,
            "err_type": self.err_type,
        }


class LogprobParams(msgspec.Struct, kw_only=True, frozen=True, gc=False, omit_defaults=True):
    """The request-side logprob options of one request, validated once (tokenizer manager) and
    carried as one value to the scheduler."""

    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position reported; -1: SGLang's default, see input_start
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None

    def input_start(self, prompt_len: int, max_new_tokens: int) -> int | None:
        """The first prompt position with an input logprob entry, or None for no input entries.

        SGLang's scheduler rule: -1 becomes the last prompt position (one entry, None: the
        first input entry is always None), except for prefill-only requests (max_new_tokens 0),
        where it skips input logprobs entirely."""
        if not self.return_logprob:
            return None
        if self.logprob_start_len >= 0:
            return self.logprob_start_len
        return prompt_len - 1 if max_new_tokens > 0 and prompt_len > 0 else None


class LogprobArrays(msgspec.Struct, kw_only=True, gc=False, array_like=True):
    """One side (prompt or output) of one request's logprobs for a run of positions.

    Rows in the leading `null_prefix` have no value (the first reported prompt position, as in
    SGLang): their floats are NaN and their top ids -1. `ids_logprobs` holds one column
    per id of the request's `token_ids_logprob`, in that order.
    """

    token_logprobs: F32Array  # [M]; NaN in the null prefix
    token_ids: I32Array  # [M]; the token at each position (always valid)
    top_vals: F32Array2D  # [M, k]
    top_idx: I32Array2D  # [M, k]
    ids_logprobs: F32Array2D  # [M, len(token_ids_logprob)]
    null_prefix: int = 0

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def empty(cls, top_logprobs_num: int = 0, num_ids: int = 0) -> "LogprobArrays":
        return cls(token_logprobs=np.zeros(0, np.float32), token_ids=np.zeros(0, np.int32),
                   top_vals=np.zeros((0, top_logprobs_num), np.float32),
                   top_idx=np.zeros((0, top_logprobs_num), np.int32),
                   ids_logprobs=np.zeros((0, num_ids), np.float32))


class TokenizedGenerateReq(_Msg, kw_only=True):
    """Tokenizer manager -> scheduler: one choice of a generation request.

    `rid` is internal (`{group}_{choice}`); the user's rid never leaves the tokenizer manager.
    """

    rid: str
    input_ids: I32Array
    sampling_params: SamplingParams
    stream: bool
    logprob: LogprobParams = LogprobParams()
    return_hidden_states: bool = False
    priority: int | None = None
    extra_key: str | None = None
    # a constrained request reasons freely first; its grammar applies after the think-end token
    require_reasoning: bool = False

    def __post_init__(self) -> None:
        # Runs on construction and on decode; a no-op for an int32 array, and it lets
        # callers pass a list of ids without a late failure on the receiving side.
        ids = np.asarray(self.input_ids, dtype=np.int32)
        if ids.ndim != 1:
            raise ValueError(f"input_ids must be 1-D, got shape {ids.shape}")
        self.input_ids = ids


class AbortReq(_Msg, kw_only=True):
    """Main -> scheduler: abort every choice of some logical requests, or everything.

    Each prefix is `"{group}_"` for an internal group id; group ids are random and of one fixed
    length, so a prefix matches that group's choices and nothing else. A call that ends with
    unfinished requests sends all its groups in one message.
    """

    group_prefixes: list[str] = []
    abort_all: bool = False
    message: str = "aborted by request"  # what the aborted requests' finish_reason says


class DetokenizeParams(msgspec.Struct, kw_only=True, frozen=True, gc=False, array_like=True):
    """How the detokenizer turns one request's tokens into text; sent once, with its first output."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_strings: tuple[str, ...] = ()
    prompt_tail: tuple[int, ...] = ()  # the prompt's last tokens: context for decoding the first output


class SpecCounts(msgspec.Struct, array_like=True, kw_only=True):
    """Speculative decoding, one request so far: verify passes, drafts proposed (as SGLang counts
    them: verify passes x drafts per verify), drafts accepted, and how many verifies accepted 0, 1,
    2, ... drafts (SGLang's spec_accept_histogram)."""

    verify_ct: int
    proposed: int
    accepted: int
    accept_histogram: list[int]


class ReqCounters(msgspec.Struct, array_like=True, kw_only=True):
    """One request's counts so far, SGLang's meta_info numbers. They travel as one struct per
    row, scheduler to front end, so a new counter is one field here and its one writer."""

    completion_tokens: int
    cached_tokens: int
    retractions: int = 0  # times retracted
    reasoning_tokens: int = 0  # require_reasoning: output tokens through the think end
    spec: SpecCounts | None = None  # on a server that speculates


class _BatchOutputBase(_Msg, kw_only=True):
    """Per-step output columns shared by the token-id and string outputs: only what changed."""

    rids: list[str]
    finished_reasons: list[FinishReason | None]
    # tokens new since the previous output of the same request
    new_token_ids: list[I32Array]
    counters: list[ReqCounters]
    # Empty when no request of the step asked for them; otherwise aligned with rids, None for
    # a request with nothing new. Output logprobs are aligned with new_token_ids; input
    # logprobs come once, whole; hidden states are rows new since the last output.
    output_logprobs: list[LogprobArrays | None] = []
    input_logprobs: list[LogprobArrays | None] = []
    hidden_states: list[F32Array2D | None] = []


class BatchTokenIDOutput(_BatchOutputBase, kw_only=True):
    """Scheduler -> detokenizer: one per step, covering every request with news.
    `detokenize_params[i]` is set in a request's first output and None after."""

    detokenize_params: list[DetokenizeParams | None]


class BatchStrOutput(_BatchOutputBase, kw_only=True):
    """Detokenizer -> tokenizer manager. ``texts[i]`` is the text new since the last output,
    already trimmed at stop strings; ``new_token_ids`` are passed through as output ids."""

    texts: list[str]


class FlushCacheReq(_Msg, kw_only=True):
    """Main -> scheduler: drop the radix cache (only succeeds when idle).

    Control requests carry a `req_id` that their reply echoes, so a late reply to a request
    that already timed out is dropped instead of answering the next one."""

    req_id: int


class FlushCacheReply(_Msg, kw_only=True):
    req_id: int
    success: bool
    message: str = ""


class GetServerInfoReq(_Msg, kw_only=True):
    """Main -> scheduler: ask for scheduler stats."""

    req_id: int


class GetServerInfoReply(_Msg, kw_only=True):
    req_id: int
    info: dict[str, Any]  # JSON-able scheduler stats


WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # what a trainer may broadcast


class WeightsReq(_Msg, kw_only=True):
    """Main -> scheduler: an operation on the served weights, SGLang's RL routes by `op`:
    update_from_disk, update_from_tensor, update_from_distributed, init_group, destroy_group,
    get_by_name, release_memory, resume_memory. An update waits for the running requests to finish (new ones wait behind
    it), unless `abort_all_requests`; then the radix cache is flushed (`flush_cache`)."""

    req_id: int
    op: str
    model_path: str = ""  # update_from_disk
    tensors: bytes = b""  # update_from_tensor: a safetensors file's bytes (no pickle crosses the wire)
    names: list[str] = []  # update_from_distributed: what the trainer broadcasts, in order
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    load_format: str = ""  # update_from_distributed: "flattened_bucket" is one broadcast of them all
    group_name: str = "weight_update_group"
    master_address: str = ""  # init_group: the trainer is rank 0 of the group and hosts its store
    master_port: int = 0
    rank_offset: int = 1  # this server's TP rank r is group rank rank_offset + r
    world_size: int = 0
    backend: str = ""  # "gloo" | "nccl"; empty: the device's
    flush_cache: bool = True
    abort_all_requests: bool = False
    name: str = ""  # get_by_name
    truncate_size: int = 100
    tags: list[str] = []  # release_memory / resume_memory: "kv_cache", "weights"


class ControlReply(_Msg, kw_only=True):
    """Scheduler -> main: the answer to a WeightsReq or a PauseReq."""

    req_id: int
    success: bool
    message: str = ""
    num_paused_requests: int = 0  # requests aborted (abort_all_requests, pause abort) or paused
    values: Any = None  # get_by_name: the weight's first truncate_size rows, as nested lists


class PauseReq(_Msg, kw_only=True):
    """Main -> scheduler: SGLang's pause_generation (mode abort | retract | in_place) or, with
    mode "continue", continue_generation."""

    req_id: int
    mode: str


class ReadyMsg(_Msg, kw_only=True):
    """Child -> main at startup, once it is ready for traffic.

    The detokenizer only knows ``role`` and ``pid``; it leaves the capacity fields at 0.
    """

    role: str  # "scheduler" | "detokenizer"
    pid: int
    max_total_tokens: int = 0
    context_len: int = 0
    vocab_size: int = 0
    max_running_requests: int = 0
    architecture: str = ""  # config.json's architectures[0] (GGUF: the architecture it maps to)
    eos_token_ids: tuple[int, ...] = ()  # the end tokens the scheduler stops on


class ChildError(_Msg, kw_only=True):
    """Child -> main when startup fails; the main process reports it and exits non-zero."""

    role: str
    message: str


Message = Union[
    TokenizedGenerateReq,
    AbortReq,
    BatchTokenIDOutput,
    BatchStrOutput,
    FlushCacheReq,
    FlushCacheReply,
    GetServerInfoReq,
    GetServerInfoReply,
    WeightsReq,
    ControlReply,
    PauseReq,
    ReadyMsg,
    ChildError,
]

MESSAGE_TYPES: tuple[type[_Msg], ...] = Message.__args__

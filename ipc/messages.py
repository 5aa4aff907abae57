"""Every message that crosses a process boundary, as tagged msgspec structs.

Each message is a ``msgspec.Struct`` with ``tag=True`` (the class name is the union tag),
``kw_only=True`` and ``gc=False`` (inherited from ``_Msg``). ``omit_defaults=True`` keeps
per-step outputs small: fields left at their default (e.g. empty logprob lists) are not sent.

Array fields are annotated ``np.ndarray`` and travel as raw little-endian buffers through the
codec's msgpack extension (see ``tandem.ipc.codec``). The aliases below only document the
expected dtype/rank; the sender is responsible for producing that dtype. Decoded arrays are
read-only views of the receive buffer: copy before mutating.

Batch outputs are column-wise: every per-request list is aligned with ``rids``. The logprob
lists are either empty (no request in this batch asked for logprobs) or aligned with ``rids``
with ``None`` for requests that did not ask.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

from tandem.runtime.sampling.params import SamplingParams

__all__ = [
    "FinishReason",
    "TokenizedGenerateReq",
    "AbortReq",
    "BatchTokenIDOutput",
    "BatchStrOutput",
    "FlushCacheReq",
    "FlushCacheReply",
    "GetServerInfoReq",
    "GetServerInfoReply",
    "HealthCheckReq",
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
    """

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The SGLang ``meta_info.finish_reason`` shape for this reason."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {
            "type": self.type,
            "message": self.message,
            "status_code": self.status_code,
            "err_type": self.err_type,
        }


class TokenizedGenerateReq(_Msg, kw_only=True):
    """Tokenizer manager -> scheduler: one generation request (one per sample when n > 1)."""

    rid: str
    input_ids: I32Array
    sampling_params: SamplingParams
    stream: bool
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    priority: int | None = None
    extra_key: str | None = None
    created_time: float

    def __post_init__(self) -> None:
        # Runs on construction and on decode; a no-op for an int32 array, and it lets
        # callers pass a list of ids without a late failure on the receiving side.
        ids = np.asarray(self.input_ids, dtype=np.int32)
        if ids.ndim != 1:
            raise ValueError(f"input_ids must be 1-D, got shape {ids.shape}")
        self.input_ids = ids


class AbortReq(_Msg, kw_only=True):
    """Abort by rid (prefix match) or everything. Sent both ways.

    Main -> scheduler: a user/client abort. Scheduler -> main: a scheduler-initiated abort
    notice (e.g. request too long), with ``finished_reason`` carrying status code + message.
    """

    rid: str = ""
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None


class _BatchOutputBase(_Msg, kw_only=True):
    """Per-step output columns shared by the token-id and string outputs."""

    rids: list[str]
    finished_reasons: list[FinishReason | None]
    # tokens new since the previous output of the same request
    new_token_ids: list[I32Array]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strings: list[list[str]]
    # output-side logprobs, aligned with new_token_ids of the same request
    output_token_logprobs_val: list[F32Array | None] = []
    output_token_logprobs_idx: list[I32Array | None] = []
    output_top_logprobs_val: list[F32Array2D | None] = []
    output_top_logprobs_idx: list[I32Array2D | None] = []
    output_token_ids_logprobs_val: list[F32Array2D | None] = []
    output_token_ids_logprobs_idx: list[I32Array2D | None] = []
    # input-side logprobs: sent once, in the first output of a request
    input_token_logprobs_val: list[F32Array | None] = []
    input_token_logprobs_idx: list[I32Array | None] = []
    input_top_logprobs_val: list[F32Array2D | None] = []
    input_top_logprobs_idx: list[I32Array2D | None] = []
    input_token_ids_logprobs_val: list[F32Array2D | None] = []
    input_token_ids_logprobs_idx: list[I32Array2D | None] = []


class BatchTokenIDOutput(_BatchOutputBase, kw_only=True):
    """Scheduler -> detokenizer: one per step, covering every request with news."""


class BatchStrOutput(_BatchOutputBase, kw_only=True):
    """Detokenizer -> tokenizer manager. ``texts[i]`` is the text new since the last output,
    already trimmed at stop strings; ``new_token_ids`` are passed through as output ids."""

    texts: list[str]


class FlushCacheReq(_Msg, kw_only=True):
    """Main -> scheduler: drop the radix cache (only succeeds when idle)."""


class FlushCacheReply(_Msg, kw_only=True):
    success: bool
    message: str = ""


class GetServerInfoReq(_Msg, kw_only=True):
    """Main -> scheduler: ask for scheduler stats."""


class GetServerInfoReply(_Msg, kw_only=True):
    info: dict[str, Any]  # JSON-able scheduler stats


class HealthCheckReq(_Msg, kw_only=True):
    """Main -> scheduler liveness probe; deep health checks use a real generate request."""

    rid: str


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
    HealthCheckReq,
    ReadyMsg,
    ChildError,
]

MESSAGE_TYPES: tuple[type[_Msg], ...] = Message.__args__

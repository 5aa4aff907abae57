"""Req: the scheduler's view of one generation request (one choice of an n>1 request)."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np

from tandem.ipc.messages import FinishReason, TokenizedGenerateReq
from tandem.runtime.sampling.logprob_format import LogprobArrays
from tandem.runtime.sampling.logprobs import InputLogprobAccumulator
from tandem.runtime.sampling.params import SamplingParams


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool
    seed: int
    arrival_seq: int
    priority: int = 0
    extra_key: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None

    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    pending_abort: FinishReason | None = None  # set by an abort; applied at the next processing

    # memory: the row in ReqToTokenPool and how many of its positions hold allocated KV slots
    req_pool_idx: int | None = None
    kv_alloc_len: int = 0
    last_node: object | None = None  # locked radix node covering the cached prefix
    cached_tokens: int = 0  # prompt tokens served from the radix cache (first prefill)
    retract_count: int = 0
    created_monotonic: float = field(default_factory=time.monotonic)

    # logprobs: input side accumulated over chunks; output side one block per sampled token
    input_logprobs: InputLogprobAccumulator | None = None
    input_logprobs_sent: bool = False
    output_logprobs: list[LogprobArrays] = field(default_factory=list)

    # streaming cursors: tokens and output logprobs already sent to the detokenizer
    sent_token_len: int = 0
    sent_logprob_len: int = 0

    @staticmethod
    def from_message(msg: TokenizedGenerateReq, arrival_seq: int) -> "Req":
        sp = msg.sampling_params
        seed = sp.sampling_seed if sp.sampling_seed is not None else random.getrandbits(32)
        req = Req(rid=msg.rid, origin_input_ids=np.asarray(msg.input_ids).tolist(), sampling_params=sp,
                  stream=msg.stream, seed=seed, arrival_seq=arrival_seq, priority=msg.priority or 0,
                  extra_key=msg.extra_key, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                  token_ids_logprob=msg.token_ids_logprob)
        if req.return_logprob and req.logprob_start_len >= 0:
            req.input_logprobs = InputLogprobAccumulator(req.origin_input_ids, req.logprob_start_len,
                                                         req.top_logprobs_num, req.token_ids_logprob)
        return req

    # -- derived views ----------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def needs_input_logprobs(self) -> bool:
        return self.input_logprobs is not None and not self.input_logprobs.done

    def max_total_len(self) -> int:
        return len(self.origin_input_ids) + self.sampling_params.max_new_tokens

"""The detokenizer process: BatchTokenIDOutput in, BatchStrOutput out, decoding incrementally."""
from __future__ import annotations

import logging
import os
import signal

import zmq

from tandem.ipc.messages import BatchStrOutput, BatchTokenIDOutput, ChildError, ReadyMsg
from tandem.ipc.sockets import IPCAddresses, bind_pull, connect_push, recv, send
from tandem.runtime.incremental_detok import DecodeState, decode_batch
from tandem.runtime.process import ParentWatch, setup_logging
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("tandem.detokenizer")
_COPIED_FIELDS = [f for f in BatchTokenIDOutput.__struct_fields__ if f in BatchStrOutput.__struct_fields__]


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def handle(self, out: BatchTokenIDOutput) -> BatchStrOutput:
        states = [self._state(out, i) for i in range(len(out.rids))]
        finished = [reason is not None for reason in out.finished_reasons]
        matched = [reason.matched if reason is not None and reason.type == "stop" else None
                   for reason in out.finished_reasons]
        texts = decode_batch(self.tokenizer, states, [ids.tolist() for ids in out.new_token_ids], finished, matched)
        for rid, fin in zip(out.rids, finished):
            if fin:
                self.states.pop(rid, None)
        return BatchStrOutput(texts=texts, **{f: getattr(out, f) for f in _COPIED_FIELDS})

    def _state(self, out: BatchTokenIDOutput, i: int) -> DecodeState:
        params = out.detokenize_params[i]
        if params is not None:  # a request's first output
            state = DecodeState(skip_special_tokens=params.skip_special_tokens,
                                spaces_between_special_tokens=params.spaces_between_special_tokens,
                                stop_strings=params.stop_strings, no_stop_trim=params.no_stop_trim,
                                context_ids=params.prompt_tail)
            self.states[out.rids[i]] = state
            return state
        return self.states[out.rids[i]]


def run_detokenizer_process(args: ServerArgs, addrs: IPCAddresses, watch: ParentWatch) -> None:
    setup_logging("detokenizer", args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    out_sock = connect_push(ctx, addrs.detokenizer_to_tokenizer)
    try:
        in_sock = bind_pull(ctx, addrs.scheduler_to_detokenizer)
        detok = Detokenizer(load_tokenizer(args.tokenizer_path or args.model_path))
    except Exception as exc:
        logger.exception("detokenizer failed to start")
        send(connect_push(ctx, addrs.scheduler_to_tokenizer), ChildError(role="detokenizer", message=str(exc)))
        raise SystemExit(1)
    send(connect_push(ctx, addrs.scheduler_to_tokenizer), ReadyMsg(role="detokenizer", pid=os.getpid()))
    while True:
        ready = in_sock.poll(1000)
        if watch.parent_gone():
            watch.exit_orphaned()
        if not ready:
            continue
        msg = recv(in_sock)
        if isinstance(msg, BatchTokenIDOutput):
            send(out_sock, detok.handle(msg))

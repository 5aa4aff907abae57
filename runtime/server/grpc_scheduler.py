"""The gateway's gRPC service `sglang.grpc.scheduler.SglangScheduler` (smg-grpc-proto's stubs).

The SGLang Model Gateway tokenizes, applies chat templates and stop strings itself, and sends
token ids. Streaming: one `chunk` per update with the new tokens (and their logprobs; the
prompt's logprobs in the first), then one `complete` per choice once it finishes, carrying its
finish reason and, as SGLang's servicer does, the last chunk's tokens again (the gateway takes
a stream's text from the chunks). Non-streaming: one `complete` per choice with the whole output. `index` tells the
choices of an n > 1 request apart; the stream ends when every choice has finished. Both carry
`reasoning_tokens`, the count that `require_reasoning` asks the scheduler for (0 without it).
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import math
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import orjson
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from tandem.runtime.model.config import MODEL_TYPES
from tandem.runtime.server.grpc_requests import scheduler_service_request
from tandem.runtime.frontend.request_groups import ChoiceState, spec_meta_info
from tandem.runtime.server.grpc_common import GrpcAuth, choice_updates
from tandem.runtime.frontend.info import VERSION, current_loads, health_generate, model_info, served_model_name, server_info
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager
from tandem.runtime.value_checks import ValidationError

_TOKENIZER_CHUNK = 1 << 20


def _top_rows(rows: list) -> list:
    return [pb.TopLogProbs(values=[t[0] for t in top or []], token_ids=[t[1] for t in top or []]) for top in rows]


def _output_logprobs(meta: dict, start: int) -> Any:
    rows = meta.get("output_token_logprobs")
    if rows is None:
        return None
    return pb.OutputLogProbs(
        token_logprobs=[r[0] for r in rows[start:]], token_ids=[r[1] for r in rows[start:]],
        top_logprobs=_top_rows((meta.get("output_top_logprobs") or [])[start:]),
        token_ids_logprobs=_top_rows((meta.get("output_token_ids_logprobs") or [])[start:]))


def _input_logprobs(meta: dict) -> Any:
    rows = meta.get("input_token_logprobs")
    if not rows:
        return None
    return pb.InputLogProbs(
        token_logprobs=[pb.InputTokenLogProb() if r[0] is None else pb.InputTokenLogProb(value=r[0]) for r in rows],
        token_ids=[r[1] for r in rows], top_logprobs=_top_rows(meta.get("input_top_logprobs") or []))


def _hidden_states(c: ChoiceState, logprob_start_len: int) -> list:
    """return_hidden_states: the choice's rows, which cover consecutive positions: the prompt's
    from logprob_start_len (when >= 0), then each output token's (its last prompt position first)."""
    rows = c.hidden_states or []
    first = logprob_start_len if logprob_start_len >= 0 else c.prompt_tokens - 1
    return [pb.HiddenStates(values=list(row), position=first + i) for i, row in enumerate(rows)]


def _complete(rid: str, c: ChoiceState, start: int = 0, with_prompt: bool = True, logprob_start_len: int = -1) -> Any:
    """A finished choice's message. `start`: where the output ids and logprobs it carries begin
    (a stream's last delta); `with_prompt`: the prompt's logprobs too (a stream sent them in its
    first chunk)."""
    meta, reason, counts = c.logprob_meta(), c.finish_reason, c.counters
    matched = reason.matched if reason is not None and reason.type == "stop" else None
    stop = {"matched_token_id": matched} if isinstance(matched, int) else (
        {"matched_stop_str": matched} if isinstance(matched, str) else {})
    spec = spec_meta_info(counts.spec, counts.completion_tokens) if counts.spec is not None else {}
    return pb.GenerateResponse(request_id=rid, complete=pb.GenerateComplete(
        output_ids=c.output_ids[start:], finish_reason=reason.type if reason is not None else "stop",
        prompt_tokens=c.prompt_tokens, completion_tokens=counts.completion_tokens,
        cached_tokens=counts.cached_tokens, reasoning_tokens=counts.reasoning_tokens,
        output_logprobs=_output_logprobs(meta, start),
        input_logprobs=_input_logprobs(meta) if with_prompt else None, all_hidden_states=_hidden_states(c, logprob_start_len),
        index=c.index, spec_accepted_tokens=spec.get("spec_accept_token_num", 0),
        spec_draft_tokens=spec.get("spec_draft_token_num", 0), **stop))


def _struct(values: dict) -> Struct:
    s = Struct()
    s.update({k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in values.items()})
    return s


class SchedulerService:
    def __init__(self, tm: TokenizerManager, auth: GrpcAuth) -> None:
        self.tm = tm
        self.auth = auth
        self.started = time.time()

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        req = scheduler_service_request(request, self.tm.limits)
        rid, stream = request.request_id, request.stream
        start_len = req.generate.logprob_start_len
        start_len = -1 if start_len is None else start_len
        with_prompt = start_len >= 0  # as SGLang's servicer: no prompt logprobs for -1 (the gateway's chat)
        sent_tokens: dict[int, int] = {}
        async for c in choice_updates(self.tm, req):
            # the update's messages are built before the first is sent (the choice may grow meanwhile)
            index, start, messages = c.index, 0, []
            if stream:  # the tokens new since this choice's last chunk: a cursor per choice
                first = index not in sent_tokens
                start = sent_tokens.get(index, 0)
                new = c.output_ids[start:]
                if new or first:
                    sent_tokens[index] = start + len(new)
                    meta, counts = c.logprob_meta(), c.counters
                    messages.append(pb.GenerateResponse(request_id=rid, chunk=pb.GenerateStreamChunk(
                        token_ids=new, prompt_tokens=c.prompt_tokens,
                        completion_tokens=counts.completion_tokens, cached_tokens=counts.cached_tokens,
                        reasoning_tokens=counts.reasoning_tokens, output_logprobs=_output_logprobs(meta, start),
                        input_logprobs=_input_logprobs(meta) if first and with_prompt else None, index=index)))
            if c.finished:
                # streaming: the last delta again, as SGLang's servicer (the prompt's logprobs went first)
                messages.append(_complete(rid, c, start, with_prompt=with_prompt and not stream,
                                          logprob_start_len=start_len))
            for message in messages:
                yield message

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        found = self.tm.abort(request.request_id)
        return pb.AbortResponse(success=found, message=f"request {request.request_id} "
                                                       f"{'aborted' if found else 'not found'}")

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        # as SGLang's servicer once it is shutting down: a probe that saw other requests' outputs
        # would pass while the gateway's next request gets UNAVAILABLE
        if (reason := self.tm.not_serving()) is not None:
            return pb.HealthCheckResponse(healthy=False, message=reason)
        try:
            await health_generate(self.tm, self.tm.args.health_generate_timeout)
        except Exception as exc:  # noqa: BLE001 - any failure is "not healthy", never an RPC error
            return pb.HealthCheckResponse(healthy=False, message=f"a 1-token generation failed: {exc}")
        return pb.HealthCheckResponse(healthy=True, message="a 1-token generation went through")

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The gateway applies `default_sampling_params_json` to every request that leaves those
        fields out, as SGLang's chat does with the model's generation_config.json."""
        info, tok = model_info(self.tm), self.tm.tokenizer
        arch = info["architectures"][0]
        defaults = self.tm.chat_sampling_defaults
        return pb.GetModelInfoResponse(
            model_path=info["model_path"], tokenizer_path=info["tokenizer_path"] or "", is_generation=True,
            served_model_name=served_model_name(self.tm.args), max_context_length=info["context_len"],
            vocab_size=info["vocab_size"], model_type=MODEL_TYPES.get(arch, ""), architectures=info["architectures"],
            eos_token_ids=info["eos_token_ids"], pad_token_id=tok.pad_token_id or 0, bos_token_id=tok.bos_token_id or 0,
            max_req_input_len=info["context_len"] - 1, weight_version=info["weight_version"],
            default_sampling_params_json=orjson.dumps(defaults).decode() if defaults else "")

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        info = await server_info(self.tm)
        started = Timestamp()
        started.FromSeconds(int(self.started))
        return pb.GetServerInfoResponse(
            # server_info's arguments and counters (no secrets), and what the gateway labels workers by
            server_args=_struct({**info, **{k: v for k, v in model_info(self.tm).items()
                                            if k in ("model_path", "weight_version", "vocab_size", "context_len")}}),
            scheduler_info=_struct(await self.tm.server_info()), active_requests=len(self.tm.groups),
            uptime_seconds=time.time() - self.started, sglang_version=VERSION, server_type="grpc",
            start_time=started, max_total_num_tokens=info.get("max_total_num_tokens", 0))

    async def GetLoads(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """One scheduler, dp_rank 0: asked for another rank, no loads (as SGLang's for a rank it lacks)."""
        report = await current_loads(self.tm, set(request.include) or None)
        load = dict(report["loads"][0])
        queues = load.pop("queues", None)
        if request.HasField("dp_rank") and request.dp_rank != 0:
            return pb.GetLoadsResponse(timestamp=report["timestamp"], version=report["version"], dp_rank_count=0)
        return pb.GetLoadsResponse(
            timestamp=report["timestamp"], version=report["version"], dp_rank_count=1,
            loads=[pb.SchedulerLoad(**load, queues=pb.QueueMetrics(**queues) if queues else None)],
            aggregate=pb.AggregateMetrics(**report["aggregate"]))

    async def FlushCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.auth.check(context, admin=True)
        if not 0.0 <= request.timeout_s < math.inf:  # NaN acted as 0 and inf waited forever for idle
            raise ValidationError("timeout_s", f"must be a finite number of seconds >= 0, got {request.timeout_s}")
        deadline = time.monotonic() + request.timeout_s
        reply = await self.tm.flush_cache()
        while not reply.success and time.monotonic() < deadline:  # wait for the scheduler to go idle
            await asyncio.sleep(0.05)
            reply = await self.tm.flush_cache()
        return common_pb2.FlushCacheResponse(success=reply.success, message=reply.message or "Cache flushed.")

    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The tokenizer's files (saved by transformers, so a GGUF's embedded tokenizer works too)
        as one zip, in chunks; the last carries its sha256."""
        data = await asyncio.get_running_loop().run_in_executor(None, self._tokenizer_zip)
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), _TOKENIZER_CHUNK):
            last = start + _TOKENIZER_CHUNK >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start:start + _TOKENIZER_CHUNK], sha256=digest if last else "")

    def _tokenizer_zip(self) -> bytes:
        buf = io.BytesIO()
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            self.tm.tokenizer.save_pretrained(tmp)
            for path in sorted(Path(tmp).iterdir()):
                zf.write(path, path.name)
        return buf.getvalue()

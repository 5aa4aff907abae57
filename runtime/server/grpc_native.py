"""SGLang's native gRPC service `sglang.runtime.v1.SglangService` over the tokenizer manager.

Generation answers as `/generate` does: cumulative `text` / `output_ids` per choice, one message
per update when streaming, one finished message per choice otherwise; `meta_info` is SGLang's,
each value a string (JSON for anything that is not one), with `index` for n > 1.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

import grpc
import orjson

from tandem.runtime.server.grpc_requests import native_service_request
from tandem.runtime.frontend.request_groups import ChoiceState
from tandem.runtime.server.grpc_common import GrpcAuth, GrpcError, choice_updates
from tandem.runtime.frontend.info import current_loads, health_generate, model_info, served_model_name, server_info
from tandem.runtime.server.proto import sglang_pb2 as pb
from tandem.runtime.frontend.tokenize import detokenize, tokenize
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager



def _meta(result: dict) -> dict[str, str]:
    meta = dict(result["meta_info"])
    if "index" in result:
        meta["index"] = result["index"]
    return {k: v if isinstance(v, str) else orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY).decode()
            for k, v in meta.items()}


class NativeService:
    def __init__(self, tm: TokenizerManager, auth: GrpcAuth) -> None:
        self.tm = tm
        self.auth = auth

    async def TextGenerate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for result, finished in self._generate(request, text=True):
            yield pb.TextGenerateResponse(text=result["text"], meta_info=_meta(result), finished=finished)

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for result, finished in self._generate(request, text=False):
            yield pb.GenerateResponse(output_ids=result["output_ids"], meta_info=_meta(result), finished=finished)

    async def _generate(self, request: Any, text: bool) -> AsyncIterator[tuple[dict, bool]]:
        """Each choice's results with SGLang's `finished` (#32588): true on one message only, the
        last of the call, once every choice of n is done; a client that stops at the first
        `finished` has every choice."""
        req = native_service_request(request, self.tm.limits, text=text)
        stream = bool(req.generate.stream)
        n = (req.generate.sampling_params or {}).get("n") or 1
        last: dict[int, ChoiceState] = {}
        done: set[int] = set()
        async for c in choice_updates(self.tm, req):
            if stream:  # the protocol's cumulative result, built from the choice when it is sent
                if c.finished:
                    done.add(c.index)
                yield c.result(), len(done) == n and c.finished
            else:  # only the finished choices' results are built
                last[c.index] = c
        for k, index in enumerate(sorted(last)):
            yield last[index].result(), k == len(last) - 1

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Healthy when a one-token generation goes through every process in time."""
        if self.tm.not_serving() is not None:  # a probe must not pass on other requests' outputs
            return pb.HealthCheckResponse(healthy=False)
        try:
            await health_generate(self.tm, self.tm.args.health_generate_timeout)
        except Exception:  # noqa: BLE001 - any failure is "not healthy", never an RPC error
            return pb.HealthCheckResponse(healthy=False)
        return pb.HealthCheckResponse(healthy=True)

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        info = model_info(self.tm)
        return pb.GetModelInfoResponse(model_path=info["model_path"], json_info=orjson.dumps(info).decode())

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return pb.GetServerInfoResponse(json_info=orjson.dumps(await server_info(self.tm), default=str).decode())

    async def ListModels(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        name = served_model_name(self.tm.args)
        return pb.ListModelsResponse(models=[pb.ModelCard(id=name, root=name,
                                                          max_model_len=self.tm.model_info["context_len"])])

    async def GetLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, f"dp_rank: this server has rank 0 only, "
                                                              f"got {request.dp_rank}")
        return pb.GetLoadResponse(json_info=orjson.dumps(await current_loads(self.tm)).decode())

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.abort_all:
            self.auth.check(context, admin=True)
        return pb.AbortResponse(success=self.tm.abort(request.rid, request.abort_all))

    async def FlushCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.auth.check(context, admin=True)
        reply = await self.tm.flush_cache()
        return pb.FlushCacheResponse(success=reply.success, message=reply.message or "Cache flushed.")

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        out = await tokenize(self.tm, {"prompt": request.text, "add_special_tokens": add_special})
        return pb.TokenizeResponse(tokens=out["tokens"], count=out["count"], max_model_len=out["max_model_len"],
                                   input_text=request.text)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Special tokens skipped, as SGLang's Detokenize decodes."""
        return pb.DetokenizeResponse(text=(await detokenize(self.tm, {"tokens": list(request.tokens)}))["text"])

"""gRPC's API keys without a server: every call needs --api-key, the calls that touch every
request the admin key, as on HTTP."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from smg_grpc_proto.generated import common_pb2

from smg_grpc_proto import sglang_scheduler_pb2 as smg_pb

from tandem.ipc.messages import FinishReason, ReqCounters, SpecCounts
from tandem.runtime.frontend.request_groups import Call, ChoiceState, RequestError, RequestGroup
from tandem.runtime.server import grpc_native, grpc_scheduler
from tandem.runtime.server.grpc_native import NativeService
from tandem.runtime.server.grpc_scheduler import SchedulerService
from tandem.runtime.server.grpc_server import GrpcAuth, _streaming, _unary, service_handler
from tandem.runtime.server.proto import sglang_pb2 as pb
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, token: str | None) -> None:
        self.metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> Any:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        raise Aborted(message)


class FakeTM:
    not_serving = TokenizerManager.not_serving  # reads dead_reason and draining, as the real one

    def __init__(self) -> None:
        self.aborted: list[tuple[str, bool]] = []

    def abort(self, rid: str, abort_all: bool = False) -> bool:
        self.aborted.append((rid, abort_all))
        return True


def call(auth: GrpcAuth, token: str | None, request: Any) -> tuple[grpc.StatusCode | None, FakeTM]:
    tm = FakeTM()
    ctx = FakeContext(token)
    try:
        asyncio.run(_unary(NativeService(tm, auth).Abort, auth)(request, ctx))
    except Aborted:
        pass
    return ctx.code, tm


@pytest.mark.parametrize("auth, token, abort_all, code", [
    (GrpcAuth(), None, True, None),  # no keys: open, as HTTP
    (GrpcAuth("k"), None, False, grpc.StatusCode.UNAUTHENTICATED),
    (GrpcAuth("k"), "wrong", False, grpc.StatusCode.UNAUTHENTICATED),
    (GrpcAuth("k"), "k", False, None),
    (GrpcAuth("k"), "k", True, None),  # no admin key: the api key is the admin key
    (GrpcAuth("k", "admin"), "k", True, grpc.StatusCode.PERMISSION_DENIED),
    (GrpcAuth("k", "admin"), "admin", True, None),
    (GrpcAuth("k", "admin"), "admin", False, None),
])
def test_abort_needs_the_api_key_and_abort_all_the_admin_key(auth, token, abort_all, code):
    got, tm = call(auth, token, pb.AbortRequest(rid="r1", abort_all=abort_all))
    assert got == code
    assert tm.aborted == ([] if code else [("r1", abort_all)])  # a refused call aborts nothing


def test_flush_cache_needs_the_admin_key():
    class FlushTM(FakeTM):
        async def flush_cache(self) -> Any:
            return pb.FlushCacheResponse(success=True, message="done")

    auth = GrpcAuth("k", "admin")
    for token, code in (("k", grpc.StatusCode.PERMISSION_DENIED), ("admin", None)):
        ctx = FakeContext(token)
        try:
            out = asyncio.run(_unary(NativeService(FlushTM(), auth).FlushCache, auth)(pb.FlushCacheRequest(), ctx))
        except Aborted:
            out = None
        assert ctx.code == code and (out is None) == (code is not None)


def test_the_gateway_service_flush_cache_needs_the_admin_key_too():
    class FlushTM(FakeTM):
        async def flush_cache(self) -> Any:
            return common_pb2.FlushCacheResponse(success=True)

    auth = GrpcAuth("k", "admin")
    ctx = FakeContext("k")
    with pytest.raises(Aborted):
        asyncio.run(_unary(SchedulerService(FlushTM(), auth).FlushCache, auth)(common_pb2.FlushCacheRequest(), ctx))
    assert ctx.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0])
def test_the_gateway_service_flush_cache_refuses_a_timeout_that_is_no_wait(timeout_s):
    """NaN flushed at once (as 0) and inf waited for idle for ever: both, and a negative, are
    INVALID_ARGUMENT naming timeout_s, and the scheduler is not asked."""
    class FlushTM(FakeTM):
        async def flush_cache(self) -> Any:
            raise AssertionError("flushed on a refused request")

    ctx = FakeContext(None)
    with pytest.raises(Aborted, match="^timeout_s "):
        asyncio.run(_unary(SchedulerService(FlushTM(), GrpcAuth()).FlushCache, GrpcAuth())(
            common_pb2.FlushCacheRequest(timeout_s=timeout_s), ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT


def test_streaming_calls_check_the_key_before_running():
    ran = []

    async def generate(request: Any, context: Any):
        ran.append(request)
        yield "token"

    async def drain(token: str | None) -> tuple[list, grpc.StatusCode | None]:
        ctx = FakeContext(token)
        out = []
        try:
            async for item in _streaming(generate, GrpcAuth("k"))("req", ctx):
                out.append(item)
        except Aborted:
            pass
        return out, ctx.code

    assert asyncio.run(drain(None)) == ([], grpc.StatusCode.UNAUTHENTICATED) and ran == []
    assert asyncio.run(drain("k")) == (["token"], None) and ran == ["req"]


def test_health_check_is_open_as_http_health_is():
    class Servicer:
        async def HealthCheck(self, request: Any, context: Any) -> Any:
            return pb.HealthCheckResponse(healthy=True)

        async def GetLoad(self, request: Any, context: Any) -> Any:
            raise AssertionError("must not run without the key")

    auth = GrpcAuth("k")
    handler = service_handler(pb.DESCRIPTOR.services_by_name["SglangService"], Servicer(), auth)

    def method(name: str) -> Any:
        class Details:
            method = f"/sglang.runtime.v1.SglangService/{name}"
        return handler.service(Details()).unary_unary

    open_ctx, closed_ctx = FakeContext(None), FakeContext(None)
    assert asyncio.run(method("HealthCheck")(pb.HealthCheckRequest(), open_ctx)).healthy and open_ctx.code is None
    with pytest.raises(Aborted):
        asyncio.run(method("GetLoad")(None, closed_ctx))
    assert closed_ctx.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("status, code", [(503, grpc.StatusCode.UNAVAILABLE), (500, grpc.StatusCode.INTERNAL)])
def test_a_request_error_is_its_status_not_unknown(status, code):
    """A control call the scheduler does not answer (HTTP's 503), or a dead child (500): the same
    status over gRPC, never UNKNOWN with a Python class name."""
    async def server_info(request: Any, context: Any) -> Any:
        raise RequestError(status, "the scheduler did not answer within 10 s")

    async def generate(request: Any, context: Any):
        raise RequestError(status, "the scheduler did not answer within 10 s")
        yield

    async def drain(ctx: FakeContext) -> None:
        async for _ in _streaming(generate, GrpcAuth())(None, ctx):
            pass

    for run in (lambda ctx: _unary(server_info, GrpcAuth())(None, ctx), drain):
        ctx = FakeContext(None)
        with pytest.raises(Aborted, match="did not answer"):
            asyncio.run(run(ctx))
        assert ctx.code == code


def test_health_checks_are_unhealthy_while_draining(monkeypatch):
    """After SIGTERM new requests get UNAVAILABLE: the probes say so, though other requests'
    outputs would pass the one-token generation's progress check."""
    async def progressing(tm: Any, timeout_s: float) -> None:
        return None

    monkeypatch.setattr(grpc_native, "health_generate", progressing)
    monkeypatch.setattr(grpc_scheduler, "health_generate", progressing)
    tm = FakeTM()
    tm.dead_reason, tm.draining = None, False
    tm.args = SimpleNamespace(health_generate_timeout=20.0)
    native = NativeService(tm, GrpcAuth())  # type: ignore[arg-type]
    gateway = SchedulerService(tm, GrpcAuth())  # type: ignore[arg-type]
    assert asyncio.run(native.HealthCheck(pb.HealthCheckRequest(), None)).healthy
    tm.draining = True
    assert not asyncio.run(native.HealthCheck(pb.HealthCheckRequest(), None)).healthy
    answer = asyncio.run(gateway.HealthCheck(smg_pb.HealthCheckRequest(), None))
    assert not answer.healthy and answer.message == "the server is shutting down"


def test_tokenize_and_detokenize_run_off_the_event_loop():
    """A long text takes seconds to tokenize: on the event loop it would stall every stream."""
    class Tokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert threading.current_thread() is not threading.main_thread()
            return [1, 2]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            assert threading.current_thread() is not threading.main_thread()
            return "ab"

    tm = FakeTM()
    tm.tokenizer, tm.model_info = Tokenizer(), {"context_len": 8, "vocab_size": 4}
    native = NativeService(tm, GrpcAuth())  # type: ignore[arg-type]
    assert list(asyncio.run(native.Tokenize(pb.TokenizeRequest(text="ab"), None)).tokens) == [1, 2]
    assert asyncio.run(native.Detokenize(pb.DetokenizeRequest(tokens=[1, 2]), None)).text == "ab"


@pytest.mark.parametrize("name, data", [
    ("Abort", b"\x0a\xff\xff\xff\xff\x0f"),  # a string whose length runs past the end
    ("Generate", b"\x0a\x02\xff\xfe"),  # request_id that is not UTF-8
])
def test_bytes_that_are_not_the_request_message_are_invalid_argument(name, data):
    """grpc answers UNKNOWN (naming DecodeError) when a deserializer raises: a client's bad bytes
    are INVALID_ARGUMENT, after the key check, and the servicer never sees them."""
    class Servicer:
        async def Abort(self, request: Any, context: Any) -> Any:
            raise AssertionError("the servicer got a malformed request")

        async def Generate(self, request: Any, context: Any):
            raise AssertionError("the servicer got a malformed request")
            yield

    handler = service_handler(smg_pb.DESCRIPTOR.services_by_name["SglangScheduler"], Servicer(), GrpcAuth())

    class Details:
        method = f"/sglang.grpc.scheduler.SglangScheduler/{name}"

    rpc = handler.service(Details())
    request = rpc.request_deserializer(data)

    async def run(ctx: FakeContext) -> None:
        if rpc.unary_unary:
            await rpc.unary_unary(request, ctx)
        else:
            async for _ in rpc.unary_stream(request, ctx):
                pass

    ctx = FakeContext(None)
    with pytest.raises(Aborted, match=f"^request is not a valid sglang.grpc.scheduler.{name}Request"):
        asyncio.run(run(ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_message_over_max_request_bytes_is_refused_before_it_is_parsed():
    """--max-request-bytes bounds a gRPC request as it bounds an HTTP body (it was 256 MiB: a
    message of token ids became a list of Python ints of several GiB in the main process)."""
    from tandem.runtime.launcher import free_port
    from tandem.runtime.server.grpc_server import bind_grpc_server

    class ArgsTM(FakeTM):
        args = type("Args", (), {"max_request_bytes": 4096})()

    async def send(size: int) -> grpc.StatusCode:
        port = free_port()
        server = bind_grpc_server(ArgsTM(), "127.0.0.1", port, GrpcAuth())  # type: ignore[arg-type]
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                abort = channel.unary_unary("/sglang.grpc.scheduler.SglangScheduler/Abort",
                                            request_serializer=smg_pb.AbortRequest.SerializeToString,
                                            response_deserializer=smg_pb.AbortResponse.FromString)
                try:
                    await abort(smg_pb.AbortRequest(request_id="r" * size), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK
        finally:
            await server.stop(None)

    assert asyncio.run(send(5000)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert asyncio.run(send(4000)) == grpc.StatusCode.OK


def _finished_choice(output_ids: list[int], spec: SpecCounts | None = None) -> ChoiceState:
    call = Call(is_batch=False, indexed=False, received=0.0)
    group = RequestGroup(logical_rid="r", group_id="g", call=call)
    return ChoiceState(rid="g_0", group=group, index=0, prompt_tokens=4, formatter=None, hidden_states=None,
                       output_ids=output_ids, finish_reason=FinishReason(type="length"),
                       counters=ReqCounters(completion_tokens=len(output_ids), cached_tokens=0, spec=spec))


def test_the_gateway_complete_carries_the_speculative_counts():
    """A speculative answer's meta_info counts (SGLang's spec_accept_token_num / spec_draft_token_num)
    go out in GenerateComplete's spec_accepted_tokens / spec_draft_tokens; without them, 0."""
    spec = SpecCounts(verify_ct=2, proposed=8, accepted=3, accept_histogram=[])
    done = grpc_scheduler._complete("r", _finished_choice([1, 2, 3, 4, 5, 6], spec)).complete
    assert (done.spec_accepted_tokens, done.spec_draft_tokens, done.finish_reason) == (3, 8, "length")
    plain = grpc_scheduler._complete("r", _finished_choice([1])).complete
    assert (plain.spec_accepted_tokens, plain.spec_draft_tokens) == (0, 0)

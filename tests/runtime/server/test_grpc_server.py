"""gRPC's API keys without a server: every call needs --api-key, the calls that touch every
request the admin key, as on HTTP."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from smg_grpc_proto.generated import common_pb2

from tandem.runtime.server.grpc_native import NativeService
from tandem.runtime.server.grpc_scheduler import SchedulerService
from tandem.runtime.server.grpc_server import GrpcAuth, _streaming, _unary, service_handler
from tandem.runtime.server.proto import sglang_pb2 as pb


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

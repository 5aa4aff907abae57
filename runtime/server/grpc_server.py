"""The gRPC server (`--grpc-port`): SGLang's native service and the gateway's scheduler service
on one grpc.aio server, on the main process's event loop beside HTTP, over the same tokenizer
manager.

Handlers are built from each service's descriptor: a method the servicer implements gets its
coroutine, every other declared method answers UNIMPLEMENTED with a reason. With --api-key every
call but HealthCheck (open, as HTTP's /health) needs `authorization: Bearer <key>` metadata
(UNAUTHENTICATED without), and the calls that touch every request (FlushCache, Abort with
abort_all) the admin key, as on HTTP. Requests become
native `/generate` bodies (grpc_requests.py); a cancelled RPC closes its result stream, which
aborts exactly that request's choices. Bytes that do not parse as the request message are
INVALID_ARGUMENT, never grpc's UNKNOWN.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError

from tandem.runtime.frontend.request_groups import RequestError
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager
from tandem.runtime.server.grpc_common import GrpcAuth, GrpcError, status_of
from tandem.runtime.value_checks import ValidationError

logger = logging.getLogger("tandem.grpc")
_OPEN_METHODS = frozenset({"HealthCheck"})  # probes need no key, as HTTP's /health


def service_handler(descriptor: Any, servicer: Any, auth: GrpcAuth) -> grpc.GenericRpcHandler:
    handlers = {}
    for method in descriptor.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name, None) or _unimplemented(descriptor.full_name, method.name,
                                                                      method.server_streaming)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        needs_key = auth if method.name not in _OPEN_METHODS else GrpcAuth()
        wrapped = _streaming(impl, needs_key) if method.server_streaming else _unary(impl, needs_key)
        handlers[method.name] = make(wrapped, request_deserializer=_parser(request_cls),
                                     response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


def _parser(request_cls: Any) -> Callable[[bytes], Any]:
    """Bytes that do not parse as the method's request message become the INVALID_ARGUMENT error
    the handler raises: a deserializer that raised would make grpc answer UNKNOWN."""
    def parse(data: bytes) -> Any:
        try:
            return request_cls.FromString(data)
        except DecodeError as exc:
            return GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"request is not a valid {request_cls.DESCRIPTOR.full_name}: {exc}")
    return parse


def _unimplemented(service: str, name: str, streaming: bool) -> Callable:
    """UNIMPLEMENTED, in the shape the handler runs (a streaming one iterates it): the gateway's
    KV-event subscription stops on UNIMPLEMENTED, and retries forever on anything else."""
    def error() -> GrpcError:
        return GrpcError(grpc.StatusCode.UNIMPLEMENTED, f"{service}/{name} is not implemented by tandem")

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise error()

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        raise error()
        yield  # a generator: raises at the first step

    return stream if streaming else unary


def _unary(impl: Callable, auth: GrpcAuth) -> Callable:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            auth.check(context)
            if isinstance(request, GrpcError):  # a request that did not parse (_parser)
                raise request
            return await impl(request, context)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except GrpcError as exc:
            await context.abort(exc.code, exc.message)
        except RequestError as exc:  # a control call the scheduler did not answer, a dead child: as HTTP's status
            await context.abort(status_of(exc.status_code), exc.message)
    return handler


def _streaming(impl: Callable, auth: GrpcAuth) -> Callable:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            auth.check(context)
            if isinstance(request, GrpcError):  # a request that did not parse (_parser)
                raise request
            async for response in impl(request, context):
                yield response
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except GrpcError as exc:
            await context.abort(exc.code, exc.message)
        except RequestError as exc:
            await context.abort(status_of(exc.status_code), exc.message)
    return handler


class GrpcPortInUse(RuntimeError):
    pass


def bind_grpc_server(tm: TokenizerManager, host: str, port: int, auth: GrpcAuth) -> grpc.aio.Server:
    """Both services on `host:port`, bound now (a taken port fails before any model loads) and
    serving once started; a request message over --max-request-bytes is RESOURCE_EXHAUSTED."""
    from smg_grpc_proto import sglang_scheduler_pb2

    from tandem.runtime.server.grpc_native import NativeService
    from tandem.runtime.server.grpc_scheduler import SchedulerService
    from tandem.runtime.server.proto import sglang_pb2

    # a request message is bounded as an HTTP body is: it is parsed, and its ids listed, on this loop
    # no SO_REUSEPORT (grpc's default): with it a second server binds a port the first listens on
    # and the kernel splits the connections between the two
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 256 << 20),
                                      ("grpc.max_receive_message_length", tm.args.max_request_bytes),
                                      ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers([
        service_handler(sglang_pb2.DESCRIPTOR.services_by_name["SglangService"], NativeService(tm, auth), auth),
        service_handler(sglang_scheduler_pb2.DESCRIPTOR.services_by_name["SglangScheduler"],
                        SchedulerService(tm, auth), auth),
    ])
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc raises on a taken port, or returns 0
        bound = 0
    if bound == 0:
        raise GrpcPortInUse(f"port {port} is in use (--grpc-port {port} on {host}): another server listens there")
    return server

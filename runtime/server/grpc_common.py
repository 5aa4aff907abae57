"""What the gRPC services (grpc_native.py, grpc_scheduler.py) and the server that hosts them
(grpc_server.py) share: the error a handler raises, the API-key check, the HTTP-to-gRPC status
map, and a request's choice updates."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from tandem.runtime.frontend.request_groups import ChoiceState, RequestError
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager
from tandem.runtime.server.auth import parse_bearer, token_is_admin, token_may_call
from tandem.runtime.server.grpc_requests import GrpcRequest
from tandem.runtime.value_checks import ValidationError

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
           413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
           499: grpc.StatusCode.CANCELLED, 503: grpc.StatusCode.UNAVAILABLE}


class GrpcError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class GrpcAuth:
    """--api-key / --admin-api-key for gRPC calls (runtime/server/auth.py has the rules)."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def check(self, context: grpc.aio.ServicerContext, admin: bool = False) -> None:
        token = _bearer(context.invocation_metadata() or ())
        if admin and not token_is_admin(token, self.api_key, self.admin_api_key):
            raise GrpcError(grpc.StatusCode.PERMISSION_DENIED, "this call needs the admin API key (--admin-api-key): "
                                                               "metadata authorization: Bearer <key>")
        if not token_may_call(token, self.api_key, self.admin_api_key):
            raise GrpcError(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: metadata "
                                                             "authorization: Bearer <--api-key>")


def _bearer(metadata: Any) -> str | None:
    return next((parse_bearer(str(value)) for key, value in metadata if key.lower() == "authorization"), None)


def status_of(http_status: int) -> grpc.StatusCode:
    return _STATUS.get(http_status, grpc.StatusCode.INTERNAL)


def grpc_error(req: GrpcRequest, exc: ValidationError | RequestError) -> GrpcError:
    if isinstance(exc, ValidationError):
        return GrpcError(grpc.StatusCode.INVALID_ARGUMENT, str(req.rename(exc)))
    return GrpcError(status_of(exc.status_code), exc.message)


async def choice_updates(tm: TokenizerManager, req: GrpcRequest) -> AsyncIterator[ChoiceState]:
    """One request's choices, each yielded when it changed (to be read at once, before the next
    await); bad input and request errors become GrpcError; closing the iterator aborts the request."""
    try:
        stream = await tm.generate_stream(req.generate, typed=True)
    except (ValidationError, RequestError) as exc:
        raise grpc_error(req, exc) from None
    try:
        async for item in stream:
            if stream.error is not None:
                raise grpc_error(req, stream.error)
            yield item
    finally:
        await stream.aclose()  # a cancelled RPC lands here: the request's choices are aborted

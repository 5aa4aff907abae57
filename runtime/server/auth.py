"""API keys, as SGLang's `--api-key` / `--admin-api-key`.

`--api-key`: every route but the probes and the scrape (exactly `/health`, `/health_generate` and
`/metrics`, as SGLang leaves open; a path that only starts like one is not open) needs `Authorization: Bearer <key>` (the admin key
is accepted too). `--admin-api-key`: the control routes that touch every request (`/flush_cache`,
`/abort_request` with `abort_all`) need it; without one they take the api key. Keys are
compared in constant time and never appear in `/server_info`. gRPC takes the same keys, as
`authorization: Bearer <key>` metadata (runtime/server/grpc_server.py).
"""
from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable

import orjson

OPEN_PATHS = frozenset({"/health", "/health_generate", "/ready", "/metrics"})  # probes and scrapers, matched exactly

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def bearer_token(headers: list[tuple[bytes, bytes]] | Any) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            return parse_bearer(value.decode("latin-1"))
    return None


def parse_bearer(value: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` value (HTTP header or gRPC metadata)."""
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def key_matches(token: str | None, key: str | None) -> bool:
    return key is not None and token is not None and hmac.compare_digest(token.encode(), key.encode())


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.api_key and not _open_route(scope):
            if not token_may_call(bearer_token(scope["headers"]), self.api_key, self.admin_api_key):
                await _deny(send, 401, "a valid API key is required: Authorization: Bearer <--api-key>")
                return
        await self.app(scope, receive, send)


def _open_route(scope: Scope) -> bool:
    return scope["path"] in OPEN_PATHS


def is_admin(headers: Any, api_key: str | None, admin_api_key: str | None) -> bool:
    """The caller may use the control routes: the admin key, or (no admin key set) the api key,
    or no keys configured at all."""
    return token_is_admin(bearer_token(headers.raw if hasattr(headers, "raw") else headers), api_key, admin_api_key)


def token_is_admin(token: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    if admin_api_key:
        return key_matches(token, admin_api_key)
    return not api_key or key_matches(token, api_key)


def token_may_call(token: str | None, api_key: str | None, admin_api_key: str | None) -> bool:
    """Any route but the control ones: the api key or the admin key, or no api key configured."""
    return not api_key or key_matches(token, api_key) or key_matches(token, admin_api_key)


async def _deny(send: Callable, status: int, message: str) -> None:
    body = orjson.dumps({"error": {"message": message, "code": status}})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})

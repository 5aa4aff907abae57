"""ApiKeyMiddleware without a server: which paths are open without the key."""
from __future__ import annotations

import asyncio

import pytest

from tandem.runtime.server.auth import ApiKeyMiddleware

KEY = "user-secret"


def _status(path: str, headers: list[tuple[bytes, bytes]] = ()) -> int:
    """The status the middleware lets through (200 from the app behind it) or answers itself."""
    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": list(headers)}
    asyncio.run(ApiKeyMiddleware(app, KEY, None)(scope, None, send))
    return sent[0]["status"]


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/ready", "/metrics"])
def test_the_probes_and_the_scrape_are_open(path):
    assert _status(path) == 200


@pytest.mark.parametrize("path", ["/healthz-admin", "/health/../flush_cache", "/health_generate2", "/metrics_dump",
                                  "/metrics/", "/healthy", "/Health", "/"])
def test_a_path_that_only_starts_like_an_open_one_needs_the_key(path):
    assert _status(path) == 401
    assert _status(path, [(b"authorization", f"Bearer {KEY}".encode())]) == 200

"""What the HTTP route modules share: JSON in (capped, timed) and out, and the control-route guard."""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from tandem.runtime.frontend.request_groups import RequestError
from tandem.runtime.frontend.validation import ValidationError
from tandem.runtime.server.auth import is_admin
from tandem.runtime.server_args import ServerArgs


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status,
                    media_type="application/json")


def error_response(status: int, message: str) -> Response:
    return json_response({"error": {"message": message, "code": status}}, status)


def control_request(request: Request, args: ServerArgs, needs_admin: bool, json_body: bool = True) -> None:
    """Control routes: no browser's cross-site request (a route with a JSON body takes only
    that content type, which no cross-site form can send; a bodiless one, SGLang's
    /flush_cache, refuses what the browser marks as cross-site) and, for what touches every
    request, the admin key."""
    if json_body:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise RequestError(415, f"{request.url.path} needs Content-Type: application/json")
    elif request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none") \
            or "origin" in request.headers:  # browsers send these; gateways and scripts do not
        raise RequestError(403, f"{request.url.path} refuses a browser's cross-site request")
    if needs_admin and not is_admin(request.headers, args.api_key, args.admin_api_key):
        raise RequestError(403, f"{request.url.path} needs the admin API key (--admin-api-key)")

async def read_json(request: Request, args: ServerArgs) -> Any:
    """The JSON body, read within --http-read-timeout and never past --max-request-bytes."""
    cap = args.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise ValidationError("body", f"is {declared} bytes, more than --max-request-bytes ({cap})")
    try:
        body = await asyncio.wait_for(_read_capped(request, cap), args.http_read_timeout)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the request body did not arrive within --http-read-timeout "
                                f"({args.http_read_timeout:g} s)") from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ValidationError("body", f"is not valid JSON: {exc}") from None


async def _read_capped(request: Request, cap: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise ValidationError("body", f"is more than --max-request-bytes ({cap}) bytes")
        chunks.append(chunk)
    return b"".join(chunks)

"""Checks on JSON request values, shared by every surface (/generate, OpenAI, gRPC) and the
sampling parameters: the one error type bad input raises (it names the field, and becomes an HTTP
400 or a gRPC INVALID_ARGUMENT), and the value predicates and printers its messages use."""
from __future__ import annotations

import math
import struct
from typing import Any

import orjson

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_F32 = struct.Struct("<f")


class ValidationError(ValueError):
    """Bad request input. `str()` names the offending field so the 400 body is actionable."""

    def __init__(self, field: str, message: str) -> None:
        # args = (field, message) keeps the exception picklable with its custom __init__.
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field} {self.message}"


def json_text(field: str, value: Any) -> str:
    """`value` as JSON text. orjson parses up to 1024 levels of nesting but writes at most 255, so a
    value a request body held may not be writable: that is the client's 400 naming `field`, not a
    TypeError out of the route (a 500), or an answer that fails after the whole generation."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:
        raise ValidationError(field, f"cannot be encoded as JSON: {exc}") from None


def type_name(v: Any) -> str:
    """How a JSON value's type is named in an error."""
    if isinstance(v, float) and v.is_integer() and abs(v) >= 2**63:  # orjson reads such an integer as a float
        return "an integer beyond 64 bits"
    return "null" if v is None else type(v).__name__


def short(v: Any, limit: int = 60) -> str:
    """repr() for error messages, cut so a huge bad value cannot blow up the 400 body."""
    try:
        r = repr(v)
    except ValueError:  # ints beyond sys.get_int_max_str_digits() refuse to print
        return f"<{type(v).__name__} too large to print>"
    except RecursionError:  # JSON nested deeper than repr can go
        return f"<{type(v).__name__} nested too deeply to print>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def key_name(key: Any) -> str:
    """An unknown key as a field name: plain when it reads cleanly, quoted repr otherwise."""
    if isinstance(key, str) and key.isprintable() and key.strip() == key and 0 < len(key) <= 40:
        return key
    return short(key, 40)


def is_int(v: Any) -> bool:
    """JSON integer: bool is a subclass of int in Python but never a valid count or id."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def finite_float(v: Any) -> float | None:
    """float(v) if v is a finite JSON number, else None (huge ints overflow float)."""
    if not is_number(v):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def finite_float32(v: Any) -> float | None:
    """The float32 value a finite JSON number becomes on the device, or None when it overflows
    float32 (the sampling tensors are float32: a float64-only value would crash the scheduler)."""
    f = finite_float(v)
    if f is None:
        return None
    try:
        return _F32.unpack(_F32.pack(f))[0]
    except OverflowError:
        return None


def fits_int64(v: int) -> bool:
    return INT64_MIN <= v <= INT64_MAX


def check_fields(body: Any, fields: tuple[str, ...], route: str) -> dict:
    """`body` as a JSON object holding none but `fields`: a 400 names the first other key."""
    if not isinstance(body, dict):
        raise ValidationError("body", "must be a JSON object")
    for key in body:
        if key not in fields:
            raise ValidationError(str(key), f"is not a field of {route} (it takes {', '.join(fields)})")
    return body

"""The one wire codec: msgpack via msgspec, numpy arrays as a msgpack extension.

Arrays travel as msgpack ext type ``ARRAY_EXT_CODE`` whose payload is a small fixed header
(dtype string, shape) followed by the array's raw little-endian bytes. Struct fields are
annotated plain ``np.ndarray``: msgspec calls ``ext_hook`` for the extension and then
``dec_hook(np.ndarray, value)`` to type-check it, so typed decoding of array fields works with
no wrapper struct. A field annotated ``np.ndarray`` rejects a msgpack list (no silent
list-of-floats on the wire).

Decoded arrays are zero-copy views into the received buffer when the data is aligned for its
dtype (otherwise copied once), and are read-only: copy before writing in place.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Any

import msgspec
import numpy as np

from tandem.ipc.messages import Message

__all__ = [
    "ARRAY_EXT_CODE",
    "WireError",
    "encode",
    "decode",
    "encode_array",
    "decode_array",
]

ARRAY_EXT_CODE = 1

# Only plain numeric dtypes cross the wire; object/void/str dtypes would need pickle-like
# semantics and have no business in IPC.
_ALLOWED_KINDS = frozenset("biuf")
# header: u8 len(dtype str), dtype str (ascii), u8 ndim, ndim x u64 little-endian
_U8 = struct.Struct("<B")
_MAX_NDIM = 32


class WireError(msgspec.DecodeError):
    """A buffer that is not a valid tandem message (subclass of msgspec.DecodeError)."""


@functools.lru_cache(maxsize=64)
def _wire_dtype(dtype: np.dtype) -> tuple[np.dtype, bytes]:
    """Explicit little-endian form of ``dtype`` and its header prefix; cached per dtype."""
    if dtype.kind not in _ALLOWED_KINDS:
        raise TypeError(f"numpy dtype {dtype} cannot go on the wire (numeric dtypes only)")
    wire = dtype.newbyteorder("<")
    dstr = wire.str.encode("ascii")
    return wire, _U8.pack(len(dstr)) + dstr


def encode_array(arr: np.ndarray) -> msgspec.msgpack.Ext:
    """Pack ``arr`` as an Ext: header then raw C-order little-endian bytes."""
    dtype, prefix = _wire_dtype(arr.dtype)
    if arr.ndim > _MAX_NDIM:
        raise TypeError(f"array with {arr.ndim} dims cannot go on the wire")
    if not (arr.flags.c_contiguous and arr.dtype == dtype):
        arr = np.ascontiguousarray(arr, dtype=dtype)
    shape = struct.pack(f"<B{arr.ndim}Q", arr.ndim, *arr.shape)
    return msgspec.msgpack.Ext(ARRAY_EXT_CODE, b"".join((prefix, shape, arr.tobytes())))


@functools.lru_cache(maxsize=64)
def _parse_dtype(dstr: bytes) -> np.dtype:
    """Validated dtype for a wire dtype string; cached because it runs per array."""
    try:
        dtype = np.dtype(dstr.decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"array ext has an invalid dtype: {exc}") from None
    if dtype.kind not in _ALLOWED_KINDS or dtype.byteorder == ">":
        raise WireError(f"array ext dtype {dtype.str} is not a little-endian numeric dtype")
    return dtype


def _parse_header(buf: memoryview) -> tuple[np.dtype, tuple[int, ...], int]:
    """Read (dtype, shape, data offset) from an array Ext payload."""
    if len(buf) < 1:
        raise WireError("array ext payload is empty")
    pos = 1 + buf[0]
    if len(buf) < pos + 1:
        raise WireError("array ext payload truncated in dtype")
    dtype = _parse_dtype(bytes(buf[1:pos]))
    ndim = buf[pos]
    end = pos + 1 + 8 * ndim
    if ndim > _MAX_NDIM or len(buf) < end:
        raise WireError("array ext payload truncated in shape")
    return dtype, struct.unpack_from(f"<{ndim}Q", buf, pos + 1), end


def decode_array(data: memoryview | bytes) -> np.ndarray:
    """Inverse of ``encode_array``'s payload; a view into ``data`` when aligned."""
    buf = memoryview(data).cast("B")
    dtype, shape, offset = _parse_header(buf)
    count = math.prod(shape)
    if len(buf) - offset != count * dtype.itemsize:
        raise WireError(
            f"array ext holds {len(buf) - offset} data bytes, "
            f"shape {shape} of {dtype.str} needs {count * dtype.itemsize}"
        )
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    if len(shape) != 1:
        arr = arr.reshape(shape)
    # Unaligned views work but are slow and upset torch.from_numpy; copy those once.
    return arr if arr.flags.aligned else arr.copy()


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return encode_array(obj)
    if isinstance(obj, np.generic):
        # numpy scalars (e.g. np.int32 token ids) go as plain msgpack numbers
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__} on the tandem wire")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != ARRAY_EXT_CODE:
        raise WireError(f"unknown msgpack ext code {code}")
    return decode_array(data)


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        raise TypeError(f"expected a numpy array ext, got {type(obj).__name__}")
    raise NotImplementedError(f"no wire decoding for {typ!r}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(Message, ext_hook=_ext_hook, dec_hook=_dec_hook)


def encode(msg: Message) -> bytes:
    """Serialize one message to bytes."""
    return _ENCODER.encode(msg)


def decode(buf: bytes | bytearray | memoryview) -> Message:
    """Parse one message; raises ``WireError`` (a msgspec.DecodeError) on bad input.

    Array fields of the result may reference ``buf``; keep it immutable while they live.
    """
    try:
        return _DECODER.decode(buf)
    except msgspec.DecodeError as exc:  # includes WireError raised by the array ext
        raise WireError(f"invalid tandem message ({len(buf)} bytes): {exc}") from exc

"""SGLang's RL routes, front-end side: weight updates, the trainer's process group, reading a
weight, pause and continue. A body is checked field by field (a 400 names the field, an unknown
one included) and becomes one WeightsReq / PauseReq for the scheduler.

Two differences from SGLang, both for safety: update_weights_from_tensor takes a safetensors
file (base64 over HTTP, raw bytes in the Engine), never pickled tensors; and the prefix cache is
dropped after every weight change whatever `flush_cache` says, because KV computed with the old
weights would answer wrongly.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any

from tandem.ipc.messages import WEIGHT_DTYPES
from tandem.runtime.value_checks import ValidationError, check_fields, is_int, type_name

_UPDATE = ("flush_cache", "abort_all_requests", "weight_version", "load_format",
           "torch_empty_cache", "recapture_cuda_graph")  # the last two: CUDA housekeeping tandem has none of
FIELDS = {
    "update_from_disk": ("model_path", *_UPDATE),
    "update_from_tensor": ("serialized_named_tensors", *_UPDATE),
    "update_from_distributed": ("names", "dtypes", "shapes", "group_name", *_UPDATE),
    "init_group": ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
    "destroy_group": ("group_name",),
    "get_by_name": ("name", "truncate_size"),
    "release_memory": ("tags",),
    "resume_memory": ("tags",),
}
# "flattened_bucket": the trainer broadcasts every tensor in one buffer (weight_sync.flatten)
LOAD_FORMATS = {"update_from_disk": ("auto", "safetensors"), "update_from_tensor": ("auto", "safetensors"),
                "update_from_distributed": ("auto", "flattened_bucket")}
MEMORY_TAGS = ("kv_cache", "weights")
PAUSE_MODES = ("abort", "retract", "in_place")


def weights_request(op: str, body: Any) -> tuple[dict[str, Any], str | None]:
    """The WeightsReq fields for `op` from a route's body, and the weight_version it names."""
    body = check_fields(body if body is not None else {}, FIELDS[op], op)
    fields: dict[str, Any] = {}
    if op.startswith("update_"):
        fields["flush_cache"] = _bool(body, "flush_cache", True)
        fields["abort_all_requests"] = _bool(body, "abort_all_requests", False)
        _bool(body, "torch_empty_cache", False)
        _bool(body, "recapture_cuda_graph", False)
        formats = LOAD_FORMATS[op]
        if body.get("load_format") not in (None, *formats):
            raise ValidationError("load_format", f"must be one of {', '.join(formats)}, got {body['load_format']!r}")
    if op == "update_from_disk":
        fields["model_path"] = _str(body, "model_path")
    elif op == "update_from_tensor":
        fields["tensors"] = _safetensors(body.get("serialized_named_tensors"))
    elif op == "update_from_distributed":
        fields.update(_tensor_list(body), load_format=body.get("load_format") or "")
    elif op == "init_group":
        fields.update(master_address=_str(body, "master_address"), master_port=_int(body, "master_port", 1, 65535),
                      rank_offset=_int(body, "rank_offset", 0), world_size=_int(body, "world_size", 2))
        backend = body.get("backend", "")
        if backend not in ("", "gloo", "nccl"):
            raise ValidationError("backend", f"must be \"gloo\" or \"nccl\", got {backend!r}")
        fields["backend"] = backend
    elif op in ("release_memory", "resume_memory"):
        tags = body.get("tags") or list(MEMORY_TAGS)  # SGLang's default: everything
        if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
            raise ValidationError("tags", f"must be a list of {', '.join(MEMORY_TAGS)}, got {tags!r}")
        fields["tags"] = tags
    elif op == "get_by_name":
        fields.update(name=_str(body, "name"), truncate_size=_int(body, "truncate_size", 1, default=100))
    if "group_name" in FIELDS[op]:
        fields["group_name"] = _str(body, "group_name", "weight_update_group")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ValidationError("weight_version", f"must be a string, got {type_name(version)}")
    return fields, version


def pause_mode(body: Any) -> str:
    body = check_fields(body if body is not None else {}, ("mode",), "pause_generation")
    mode = body.get("mode", "abort")  # SGLang's default
    if mode not in PAUSE_MODES:
        raise ValidationError("mode", f"must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return mode


def _safetensors(value: Any) -> bytes:
    """One base64 safetensors file; SGLang's per-TP-rank list is taken when its entries are one file."""
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        value = value[0]
    if not isinstance(value, str):
        raise ValidationError("serialized_named_tensors", "must be a base64 safetensors file (a string, or a list "
                                                          f"of copies of one), got {type_name(value)}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError("serialized_named_tensors", "is not valid base64") from None


def _tensor_list(body: dict) -> dict[str, Any]:
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not names:
        raise ValidationError("names", "must be a non-empty list of weight names")
    for field, value in (("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, list) or len(value) != len(names):
            raise ValidationError(field, f"must be a list as long as names ({len(names)})")
    if not all(isinstance(d, str) for d in dtypes):
        raise ValidationError("dtypes", "must be strings such as \"bfloat16\"")
    if not all(isinstance(s, list) and all(is_int(d) and d >= 0 for d in s) for s in shapes):
        raise ValidationError("shapes", "must be lists of non-negative integers")
    for i, d in enumerate(dtypes):
        if d.removeprefix("torch.") not in WEIGHT_DTYPES:
            raise ValidationError(f"dtypes[{i}]", f"{d!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    return {"names": names, "dtypes": dtypes, "shapes": shapes}


def _bool(body: dict, field: str, default: bool) -> bool:
    value = body.get(field, default)
    if not isinstance(value, bool):
        raise ValidationError(field, f"must be a boolean, got {type_name(value)}")
    return value


def _str(body: dict, field: str, default: str | None = None) -> str:
    value = body.get(field, default)
    if not isinstance(value, str) or not value:
        raise ValidationError(field, f"must be a non-empty string, got {type_name(value)}")
    return value


def _int(body: dict, field: str, low: int, high: int | None = None, default: int | None = None) -> int:
    value = body.get(field, default)
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValidationError(field, f"must be an integer {bound}, got {value!r}")
    return value

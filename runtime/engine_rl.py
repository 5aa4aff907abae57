"""The Engine's training-loop methods, with SGLang's names and keywords: weight updates, the
trainer's process group, reading a weight, pause and continue (frontend/weights.py says how
tandem's differ: a safetensors file rather than pickled tensors, and the cache always dropped).

Each update returns (success, message); a refused one changed nothing.
"""
from __future__ import annotations

import base64
from typing import Any

from tandem.runtime.frontend.weights import pause_mode, weights_request


class EngineRL:
    """Mixed into Engine, which provides `_run` (run a coroutine on its loop) and `_live`."""

    def _weights(self, op: str, body: dict[str, Any]) -> Any:
        fields, version = weights_request(op, {k: v for k, v in body.items() if v is not None})
        return self._run(self._live().weights(op, fields, version))  # type: ignore[attr-defined]

    def _update(self, op: str, body: dict[str, Any]) -> tuple[bool, str]:
        reply = self._weights(op, body)
        return reply.success, reply.message

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False, weight_version: str | None = None,
                                 flush_cache: bool = True) -> tuple[bool, str]:
        return self._update("update_from_disk", {"model_path": model_path, "load_format": load_format,
                                                 "abort_all_requests": abort_all_requests,
                                                 "weight_version": weight_version, "flush_cache": flush_cache})

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]] | bytes, load_format: str | None = None,
                                   flush_cache: bool = True, abort_all_requests: bool = False,
                                   weight_version: str | None = None) -> tuple[bool, str]:
        """`named_tensors`: (name, tensor) pairs, or a safetensors file's bytes."""
        if not isinstance(named_tensors, bytes):
            from safetensors.torch import save

            named_tensors = save({name: t.detach().contiguous().cpu() for name, t in named_tensors})
        return self._update("update_from_tensor", {
            "serialized_named_tensors": base64.b64encode(named_tensors).decode(), "load_format": load_format,
            "flush_cache": flush_cache, "abort_all_requests": abort_all_requests, "weight_version": weight_version})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str | None = None) -> tuple[bool, str]:
        """Join the trainer's group (it is rank 0); returns once every rank has joined."""
        return self._update("init_group", {"master_address": master_address, "master_port": master_port,
                                           "rank_offset": rank_offset, "world_size": world_size,
                                           "group_name": group_name, "backend": backend})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        abort_all_requests: bool = False, weight_version: str | None = None,
                                        load_format: str | None = None) -> tuple[bool, str]:
        """Receive these tensors from the trainer's broadcasts (in this order) and serve them: one
        broadcast each, or with load_format="flattened_bucket" one of them all (weight_sync.flatten)."""
        return self._update("update_from_distributed", {
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests, "weight_version": weight_version, "load_format": load_format})

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        return self._update("destroy_group", {"group_name": group_name})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        reply = self._weights("get_by_name", {"name": name, "truncate_size": truncate_size})
        if not reply.success:
            raise ValueError(reply.message)
        return reply.values

    def update_weight_version(self, new_version: str) -> None:
        self._live().weight_version = new_version  # type: ignore[attr-defined]

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Free the KV pool and/or the weights ("kv_cache", "weights"; default both) while no request
        holds KV; nothing generates until resume_memory_occupation."""
        return self._update("release_memory", {"tags": tags})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Bring them back: the KV pool zeroed, the weights read again from the model path last
        loaded from disk (push weights sent over a group or as tensors again, as SGLang without
        --enable-weights-cpu-backup)."""
        return self._update("resume_memory", {"tags": tags})

    def pause_generation(self, mode: str = "abort") -> int:
        """Returns how many requests the pause touched (aborted, retracted or held)."""
        return self._run(self._live().pause(pause_mode({"mode": mode}))).num_paused_requests  # type: ignore[attr-defined]

    def continue_generation(self) -> None:
        self._run(self._live().pause("continue"))  # type: ignore[attr-defined]

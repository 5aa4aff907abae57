"""WeightsControl: the scheduler's side of SGLang's weight routes (WeightsReq), on every TP rank.

It owns the pending operations: `submit` queues one (an update stops admission at once, so the
running requests finish on the old weights), `run_pending` runs them once the scheduler has no
step in flight and, for an update, no request holds KV computed with the old weights. Each runs
on the forward thread (ForwardWorker.call). An update reads every tensor first (from disk, from the request's
safetensors bytes, or from the trainer's broadcasts, which must all be received whatever
fails), checks them all (weight_update.check; a broadcast update from its names, dtypes and
shapes, before the first byte), then, every value in hand, writes them in place
(weight_update.apply); a refused or failed update changes nothing.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tandem.ipc.messages import WeightsReq, ControlReply
from tandem.runtime.host_malloc import release_freed_heap
from tandem.runtime.model import weight_update
from tandem.runtime.model.loader import load_config, load_hf_weights
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.model.weight_sync import WeightsGroup, init_weights_group, parse_dtype, receive
from tandem.runtime.scheduler.core import SchedulerCore
from tandem.runtime.scheduler.forward_worker import ForwardWorker

logger = logging.getLogger("tandem.scheduler")
UPDATES = ("update_from_disk", "update_from_tensor", "update_from_distributed")


class WeightsControl:
    def __init__(self, runner: ModelRunner, worker: ForwardWorker) -> None:
        self.runner = runner
        self.worker = worker
        self.groups: dict[str, WeightsGroup] = {}  # group_name -> process group with a trainer
        self.pending: list[WeightsReq] = []
        self._aborted_for: dict[int, int] = {}  # update req_id -> requests its abort_all_requests ended

    def submit(self, msg: WeightsReq, core: SchedulerCore) -> None:
        if msg.op in UPDATES:
            if msg.abort_all_requests:
                self._aborted_for[msg.req_id] = len(core.abort([], True, "the weights are being updated"))
            core.planner.hold_waiting = True  # the running requests finish on the old weights
        self.pending.append(msg)

    def run_pending(self, core: SchedulerCore) -> list[ControlReply]:
        """The pending operations' replies (none while an update waits for running requests; ones
        paused in place are retracted, to compute their KV again with the new weights)."""
        if any(msg.op in UPDATES for msg in self.pending) and core.holds_kv():
            if not core.paused:
                return []
            core.retract_all()
        msgs, self.pending = self.pending, []
        replies = [self._run_one(msg, core) for msg in msgs]
        core.planner.hold_waiting = False
        return replies

    def _run_one(self, msg: WeightsReq, core: SchedulerCore) -> ControlReply:
        if msg.op == "release_memory":
            if core.holds_kv():
                return ControlReply(req_id=msg.req_id, success=False, message="requests hold KV memory: "
                                    "pause_generation (mode retract or abort) first")
            core.kv.flush()  # the cache's KV is in the pool that goes
        reply = self.run(msg)
        core.memory_released = bool(self.runner.memory_released)
        if msg.op in UPDATES:
            if reply.success:  # KV cached from the old weights would answer wrongly: always dropped
                core.kv.flush()
            reply.num_paused_requests = self._aborted_for.pop(msg.req_id, 0)
        return reply

    def run(self, msg: WeightsReq) -> ControlReply:
        handler: Callable[[WeightsReq], ControlReply] = getattr(self, f"_{msg.op}")
        if self.runner.model is None and msg.op not in ("resume_memory", "release_memory", "destroy_group"):
            return ControlReply(req_id=msg.req_id, success=False, message=f"{msg.op}: the weights are released "
                                "(release_memory_occupation); resume_memory_occupation first")
        try:
            return self.worker.call(lambda: handler(msg)).result()
        except Exception as exc:  # a bad path, an unreachable trainer: the server serves on
            logger.warning("%s refused: %s", msg.op, exc, exc_info=not isinstance(exc, (ValueError, OSError)))
            return ControlReply(req_id=msg.req_id, success=False, message=f"{msg.op}: {exc}")

    # -- updates: read everything, check everything, then write ----------------------------------------
    def _update_from_disk(self, msg: WeightsReq) -> ControlReply:
        cfg = load_config(msg.model_path)
        if cfg.arch != self.runner.config.arch:
            raise ValueError(f"{msg.model_path} is a {cfg.arch}; the server serves a {self.runner.config.arch}")
        clock = _Clock()
        tensors = load_hf_weights(msg.model_path, cfg)
        clock.lap("read")
        reply = self._apply(msg, tensors.items(), clock)
        self.runner.model_path = msg.model_path  # what resume_memory_occupation reads the weights from
        return reply

    def _update_from_tensor(self, msg: WeightsReq) -> ControlReply:
        from safetensors.torch import load

        try:
            tensors = load(msg.tensors)
        except Exception as exc:  # safetensors' own errors do not say what was being read
            raise ValueError(f"serialized_named_tensors is not a safetensors file ({exc})") from exc
        return self._apply(msg, tensors.items())

    def _update_from_distributed(self, msg: WeightsReq) -> ControlReply:
        """Checked from the names, dtypes and shapes before the first byte arrives; written once
        every tensor has arrived."""
        group = self.groups.get(msg.group_name)
        if group is None:
            raise ValueError(f"no weights update group {msg.group_name!r}: call init_weights_update_group first")
        r = self.runner
        specs = [(parse_dtype(dtype), shape) for dtype, shape in zip(msg.dtypes, msg.shapes)]
        flattened = msg.load_format == "flattened_bucket"
        metas = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, (dtype, shape) in zip(msg.names, specs)]
        clock = _Clock()
        try:
            checked = weight_update.check(r.model, r.config, r.tp, metas)
        except ValueError:
            receive(group, specs, r.device, flattened)  # the trainer sends them all whatever
            raise
        clock.lap("check")
        # every byte lands in the group's warm arena before the first write: a transfer that fails part
        # way changes nothing, and the writes go in place (no fresh staging memory to fault in)
        arrived = receive(group, specs, r.device, flattened)
        clock.lap("transfer")
        changed = weight_update.apply(r.model, [(target, target.shard(t)) for (target, _), t in zip(checked, arrived)])
        clock.lap("copy + repack")
        return self._reply(msg, changed, clock)

    def _apply(self, msg: WeightsReq, tensors, clock: _Clock | None = None) -> ControlReply:
        model, r, clock = self.runner.model, self.runner, clock or _Clock()
        checked = weight_update.check(model, r.config, r.tp, tensors)
        clock.lap("check")
        changed = weight_update.apply(model, checked)  # every tensor in hand: written in place
        clock.lap("copy + repack")
        return self._reply(msg, changed, clock)

    def _reply(self, msg: WeightsReq, changed: int, clock: _Clock) -> ControlReply:
        clock.lap("commit")
        logger.info("%s: %d weights updated (%s)", msg.op, changed, clock)
        return ControlReply(req_id=msg.req_id, success=True, message=f"{changed} weights updated")

    # -- the trainer's group ---------------------------------------------------------------------------
    def _init_group(self, msg: WeightsReq) -> ControlReply:
        if msg.group_name in self.groups:
            raise ValueError(f"weights update group {msg.group_name!r} exists already")
        backend = msg.backend or ("nccl" if self.runner.device.type == "cuda" else "gloo")
        rank = msg.rank_offset + self.runner.tp.rank
        self.groups[msg.group_name] = init_weights_group(msg.master_address, msg.master_port, rank, msg.world_size,
                                                         msg.group_name, backend)
        return ControlReply(req_id=msg.req_id, success=True, message=f"joined {msg.group_name!r} as rank {rank}")

    def _destroy_group(self, msg: WeightsReq) -> ControlReply:
        if self.groups.pop(msg.group_name, None) is None:
            raise ValueError(f"no weights update group {msg.group_name!r}")
        return ControlReply(req_id=msg.req_id, success=True, message=f"left {msg.group_name!r}")

    # -- memory ----------------------------------------------------------------------------------------
    def _release_memory(self, msg: WeightsReq) -> ControlReply:
        self.runner.release_memory(msg.tags)
        if "weights" in msg.tags:
            for group in self.groups.values():
                group.drop_arena()
        release_freed_heap()
        return ControlReply(req_id=msg.req_id, success=True, message=f"released {', '.join(msg.tags)}")

    def _resume_memory(self, msg: WeightsReq) -> ControlReply:
        self.runner.resume_memory(msg.tags)
        return ControlReply(req_id=msg.req_id, success=True, message=f"resumed {', '.join(msg.tags)}")

    # -- reading ---------------------------------------------------------------------------------------
    def _get_by_name(self, msg: WeightsReq) -> ControlReply:
        """The named weight as the checkpoint holds it (a q_proj is its rows of the fused qkv)."""
        r = self.runner
        target = weight_update.locate(msg.name, r.config, r.tp)
        if target.param not in weight_update.shapes(r.model):  # the same on every rank: none gathers
            raise ValueError(f"{msg.name}: the model has no such weight")
        value = weight_update.read(r.model, target.param)[target.index]
        if r.tp.size > 1:  # every rank runs this op: the whole tensor from their shards
            value = weight_update.gather_shards(value, target, r.tp)
        return ControlReply(req_id=msg.req_id, success=True, values=value[:msg.truncate_size].float().tolist())



class _Clock:
    """The seconds one update spends in each of its phases, for its log line."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{phase} {seconds * 1e3:.1f} ms" for phase, seconds in self.phases.items())

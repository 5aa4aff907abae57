"""The scheduler process: receive -> plan step N+1 -> launch N+1 -> process step N -> stream outputs.

With `--disable-overlap-schedule` the same pieces run in sequence (launch, wait, process).
"""
from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from collections import deque
from concurrent.futures import Future

import zmq

from tandem.ipc.messages import (AbortReq, BatchTokenIDOutput, ChildError, FinishReason, FlushCacheReply, FlushCacheReq,
                                 GetServerInfoReply, GetServerInfoReq, ReadyMsg, TokenizedGenerateReq)
from tandem.ipc.sockets import IPCAddresses, bind_pull, connect_push, recv_all_nowait, send
from tandem.runtime.envs import envs
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.scheduler.batch import ScheduleBatch
from tandem.runtime.scheduler.forward_worker import ForwardWorker
from tandem.runtime.scheduler.future_map import FutureMap
from tandem.runtime.scheduler.kv_manager import KVManager
from tandem.runtime.scheduler.output_streamer import OutputStreamer
from tandem.runtime.scheduler.planner import Planner
from tandem.runtime.scheduler.request import Req
from tandem.runtime.scheduler.result_processor import FinishChecker, apply_new_tokens
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("tandem.scheduler")
_LOG_EVERY_STEPS = 40


class Scheduler:
    def __init__(self, args: ServerArgs, addrs: IPCAddresses) -> None:
        self.args = args
        self.overlap = not args.disable_overlap_schedule
        self.runner = ModelRunner(args)
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        eos = set(self.runner.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = sorted(eos)
        self.kv = KVManager(self.runner.req_to_token_pool, self.runner.allocator, args.disable_radix_cache)
        self.future_map = FutureMap(self.runner.req_to_token_pool.size, self.runner.device,
                                    debug=envs.DEBUG_FUTURE_MAP.get())
        self.worker = ForwardWorker(self.runner, self.future_map)
        self.planner = Planner(args, self.runner, self.kv, self.eos_ids, self._finish)
        self.checker = FinishChecker(self.eos_ids, lambda ids: self.tokenizer.decode(ids))
        self.streamer = OutputStreamer(args.stream_interval)
        self._arrivals = 0
        self._step_times: deque[float] = deque(maxlen=2000)
        self._steps = 0
        self._gen_tokens = 0
        self._last_log = time.perf_counter()
        self.ctx = zmq.Context(2)
        self.recv_sock = bind_pull(self.ctx, addrs.tokenizer_to_scheduler)
        self.detok_sock = connect_push(self.ctx, addrs.scheduler_to_detokenizer)
        self.reply_sock = connect_push(self.ctx, addrs.scheduler_to_tokenizer)

    # -- the loop -----------------------------------------------------------------------------------
    def event_loop(self) -> None:
        in_flight: tuple[ScheduleBatch, Future] | None = None
        busy = False
        parent = os.getppid()
        while True:
            idle = in_flight is None and not self.planner.has_work()
            self._receive(block_ms=500 if idle else 0)
            if idle and os.getppid() != parent:
                return  # the main process is gone: never linger as an orphan
            t0 = time.perf_counter()
            batch = self.planner.next_batch()
            if batch is not None:
                batch.job.follows_busy_step = busy
                batch.rows_to_free = self.kv.take_deferred_rows()
            launched = (batch, self.worker.submit(batch.job)) if batch is not None else None
            busy = batch is not None or in_flight is not None
            waited = 0.0
            if in_flight is not None:
                waited += self._process(*in_flight)
            in_flight = launched
            if not self.overlap and in_flight is not None:
                waited += self._process(*in_flight)
                in_flight = None
            if in_flight is None:  # nothing can read a released row any more
                self.kv.free_rows(self.kv.take_deferred_rows())
            self._flush_outputs()
            if batch is not None:  # CPU time of this iteration, not counting waits for the device
                self._step_times.append(time.perf_counter() - t0 - waited)
                self._maybe_log(batch)

    def _receive(self, block_ms: int) -> None:
        if block_ms and not self.recv_sock.poll(block_ms):
            return
        for msg in recv_all_nowait(self.recv_sock):
            self._handle(msg)
        self.planner.expire_timeouts(self._finish)

    def _handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self._add_request(msg)
        elif isinstance(msg, AbortReq):
            for req in self.planner.find(msg.rid, msg.abort_all):
                self._finish(req, FinishReason(type="abort", message="aborted by request", status_code=200,
                                               err_type="abort"))
        elif isinstance(msg, FlushCacheReq):
            ok = self.planner.idle()
            if ok:
                self.kv.flush()
                self.future_map.poison(list(range(self.runner.req_to_token_pool.size)))
            send(self.reply_sock, FlushCacheReply(success=ok, message="" if ok else "requests are still running"))
        elif isinstance(msg, GetServerInfoReq):
            send(self.reply_sock, GetServerInfoReply(info=self.server_info()))

    def _add_request(self, msg: TokenizedGenerateReq) -> None:
        self._arrivals += 1
        req = Req.from_message(msg, self._arrivals)
        error = self.planner.admission_error(req)
        if error is not None:
            req.finished_reason = error
            self.streamer.add(req)
            return
        self.planner.add(req)

    # -- results ---------------------------------------------------------------------------------------
    def _process(self, batch: ScheduleBatch, fut: Future) -> float:
        """Apply a finished step's results; returns how long it waited for the step to finish."""
        t0 = time.perf_counter()
        result = fut.result()
        waited = time.perf_counter() - t0
        self.kv.free_rows(batch.rows_to_free)  # rows released before this step launched
        for req_index, first_row, chunk in result.input_logprob_chunks:
            req = batch.input_logprob_reqs[req_index]
            if not req.finished:
                req.input_logprobs.add_chunk(chunk, first_row)  # type: ignore[union-attr]
        for j, req in enumerate(batch.sampling_reqs):
            if req.finished:  # finished or aborted while this step was in flight
                continue
            lp = result.output_logprobs[j] if result.output_logprobs else None
            done = apply_new_tokens(req, [result.next_token_ids[j]], [lp] if lp is not None else None, self.checker)
            self._gen_tokens += 1
            if done:
                self._finish(req, req.finished_reason)
            else:
                self.streamer.add(req)
        return waited

    def _finish(self, req: Req, reason: FinishReason | None) -> None:
        req.finished_reason = reason
        row = req.req_pool_idx
        self.planner.remove(req)
        self.kv.release(req)
        if row is not None:
            self.planner.poison_later(row)
        self.streamer.add(req)

    def _flush_outputs(self) -> None:
        out: BatchTokenIDOutput | None = self.streamer.build()
        if out is not None:
            send(self.detok_sock, out)

    # -- visibility ---------------------------------------------------------------------------------------
    def server_info(self) -> dict:
        alloc = self.runner.allocator
        median, p99 = _median_p99_ms(self._step_times)
        return {
            "max_total_num_tokens": self.runner.max_total_tokens,
            "kv_slots_free": alloc.available_size(),
            "kv_slots_cached": self.kv.tree.total_size(),
            "kv_slots_used": self.runner.max_total_tokens - alloc.available_size() - self.kv.tree.evictable_size(),
            "req_rows_free": self.runner.req_to_token_pool.available_size(),
            "req_rows_total": self.runner.req_to_token_pool.size,
            "num_running_reqs": len(self.planner.running) + (self.planner.chunked_req is not None),
            "num_queue_reqs": len(self.planner.waiting),
            "overlap_schedule": self.overlap,
            "device_idle_fraction": round(self.worker.idle_fraction(), 4),
            "device_busy_s": round(self.worker.busy_idle_seconds()[0], 4),
            "device_idle_s": round(self.worker.busy_idle_seconds()[1], 4),
            "step_time_median_ms": median,
            "step_time_p99_ms": p99,
            "num_steps": self._steps,
            "num_retractions": self.planner.num_retractions,
        }

    def _maybe_log(self, batch: ScheduleBatch) -> None:
        """SGLang-style batch lines: every prefill, and every 40th decode step."""
        self._steps += 1
        used = self.runner.max_total_tokens - self.kv.available_tokens()
        usage = used / self.runner.max_total_tokens
        if batch.mode == ForwardMode.EXTEND:
            logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                        "#running-req: %d, #queue-req: %d", len(batch.reqs), batch.num_tokens,
                        sum(batch.job.prefix_lens), usage, len(self.planner.running), len(self.planner.waiting))
            return
        if self._steps % _LOG_EVERY_STEPS:
            return
        now = time.perf_counter()
        rate = self._gen_tokens / max(now - self._last_log, 1e-9)
        self._gen_tokens, self._last_log = 0, now
        median, p99 = _median_p99_ms(self._step_times)
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                    "#queue-req: %d, overlap: %s, device idle: %.1f%%, step (median/p99 ms): %.2f/%.2f",
                    len(self.planner.running), used, usage, rate, len(self.planner.waiting), self.overlap,
                    100 * self.worker.idle_fraction(), median, p99)


def _median_p99_ms(samples) -> tuple[float, float]:
    times = sorted(samples)
    if not times:
        return 0.0, 0.0
    return round(statistics.median(times) * 1e3, 3), round(times[min(int(len(times) * 0.99), len(times) - 1)] * 1e3, 3)


def run_scheduler_process(args: ServerArgs, addrs: IPCAddresses) -> None:
    """Entry point of the spawned scheduler process."""
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s scheduler] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when we stop
    ctx = zmq.Context()
    try:
        scheduler = Scheduler(args, addrs)
    except Exception as exc:
        logger.exception("scheduler failed to start")
        sock = connect_push(ctx, addrs.scheduler_to_tokenizer)
        send(sock, ChildError(role="scheduler", message=f"{type(exc).__name__}: {exc}"))
        sock.close(linger=1000)
        raise SystemExit(1)
    r = scheduler.runner
    send(scheduler.reply_sock, ReadyMsg(role="scheduler", pid=os.getpid(), max_total_tokens=r.max_total_tokens,
                                        context_len=r.context_len, vocab_size=r.config.vocab_size,
                                        max_running_requests=r.max_running_requests))
    scheduler.event_loop()

"""The scheduler process shell: receive -> plan step N+1 -> launch N+1 -> apply step N -> stream.

Every request transition is SchedulerCore's (core.py); this file holds what a process needs
around it: the model and its forward worker, tensor parallelism, the sockets and the loop. With
`--disable-overlap-schedule` the same pieces run in sequence (launch, wait, apply). Control
requests that must not race a step in flight (a cache flush) wait for the point where no step
is in flight.
"""
from __future__ import annotations

import logging
import os
import signal
import time

import torch
import zmq

from tandem.ipc.messages import (AbortReq, ChildError, ControlReply, FlushCacheReply, FlushCacheReq,
                                 GetServerInfoReply, GetServerInfoReq, Message, PauseReq, ReadyMsg,
                                 TokenizedGenerateReq, WeightsReq)
from tandem.ipc.sockets import IPCAddresses, bind_pull, connect_push, recv_all_nowait, send
from tandem.runtime.envs import envs
from tandem.runtime.grammar.backend import GrammarBackend
from tandem.runtime.host_malloc import keep_freed_heap
from tandem.runtime.process import ParentWatch, node_tp_ranks, setup_logging
from tandem.runtime.model.forward_batch import ForwardMode
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.model.tensor_parallel import SINGLE, init_tensor_parallel
from tandem.runtime.sampling.penalties import PenaltyCounts
from tandem.runtime.scheduler.batch import BatchContext, ScheduleBatch
from tandem.runtime.scheduler.core import SchedulerCore
from tandem.runtime.scheduler.forward_worker import ForwardWorker, GenerationBatchResult, reserve_intra_op_threads
from tandem.runtime.scheduler.future_map import FutureMap
from tandem.runtime.scheduler.grammar_queue import GrammarQueue
from tandem.runtime.scheduler.kv_manager import KVManager
from tandem.runtime.scheduler.output_streamer import OutputStreamer
from tandem.runtime.scheduler.planner import Planner, PlannerConfig
from tandem.runtime.scheduler.req_rows import ReqRows
from tandem.runtime.scheduler.request import Req
from tandem.runtime.scheduler.result_processor import FinishChecker
from tandem.runtime.scheduler.stats import StepStats
from tandem.runtime.scheduler.tp_sync import ControlSync, lockstep_settings
from tandem.runtime.scheduler.watchdog import Watchdog
from tandem.runtime.scheduler.weights_control import WeightsControl
from tandem.runtime.reasoning import THINK_END
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.speculative.drafter import Drafter, NgramDrafter
from tandem.runtime.speculative.standalone import StandaloneDrafter
from tandem.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("tandem.scheduler")
GRAMMAR_POLL_MS = 5


def make_drafter(args: ServerArgs, runner: ModelRunner) -> Drafter | None:
    if args.speculative_algorithm is None:
        return None
    pool, num_drafts = runner.req_to_token_pool, args.speculative_num_draft_tokens - 1
    if args.speculative_algorithm == "STANDALONE":
        return StandaloneDrafter(runner.draft_model, runner.draft_attn_backend, pool.req_to_token, num_drafts,
                                 runner.device)
    return NgramDrafter(pool.size, pool.req_to_token.shape[1], num_drafts,
                        args.speculative_ngram_min_match_window_size, args.speculative_ngram_max_match_window_size)


class Scheduler:
    def __init__(self, args: ServerArgs, addrs: IPCAddresses, watch: ParentWatch | None = None,
                 tp_rank: int = 0) -> None:
        self.args = args
        self.watch = watch
        self.overlap = not args.disable_overlap_schedule
        intra_op_threads = reserve_intra_op_threads()  # before the model loads: see its docstring
        device = torch.device(args.resolved_device())
        if device.type == "cpu":  # this node's ranks share its cores
            intra_op_threads = max(1, intra_op_threads // len(node_tp_ranks(args)))
        tp, self.sync = SINGLE, None
        if args.tp_size > 1:  # rank 0 leads: it alone talks to the other processes (tp_sync.py)
            tp, control = init_tensor_parallel(tp_rank, args.tp_size, args.dist_init_addr, device, args.dist_timeout)
            self.sync = ControlSync(tp_rank, control)
            rank0 = self.sync.agree(lockstep_settings(args))  # each node was launched on its own: refuse a mismatch
            self.args = args = args.replace(random_seed=rank0["random_seed"])
        self.runner = runner = ModelRunner(args, tp, pack_now=False)  # the forward worker packs
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        eos = set(runner.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        eos_ids = tuple(sorted(eos))
        pool = runner.req_to_token_pool
        drafter = make_drafter(args, runner)
        future_map = FutureMap(pool.size, runner.device, max_draft_tokens=drafter.num_drafts if drafter else 1,
                               debug=envs.DEBUG_FUTURE_MAP.get())
        penalty_counts = PenaltyCounts(pool.size, runner.config.vocab_size, runner.device)
        rows = ReqRows(pool, future_map, penalty_counts)
        self.kv = KVManager(rows, runner.allocator, args.disable_radix_cache)
        self.stats = StepStats()
        self.worker = ForwardWorker(runner, future_map, penalty_counts, self.stats, drafter, intra_op_threads)
        think_end_ids = tuple(self.tokenizer.encode(THINK_END, add_special_tokens=False))
        planner = Planner(PlannerConfig.from_args(args, runner), self.kv,
                          BatchContext(runner.config.vocab_size, eos_ids, runner.device))
        self.checker = FinishChecker(eos_ids, lambda ids: self.tokenizer.decode(ids))
        streamer = OutputStreamer(args.stream_interval,
                                  args.speculative_num_draft_tokens - 1 if args.speculative_algorithm else 0)
        self.num_outputs_sent = 0  # to the detokenizer: /health_generate checks they all came through
        self.grammar: GrammarBackend | None = None
        grammar_queue: GrammarQueue | None = None
        if args.grammar_backend == "xgrammar":
            self.grammar = GrammarBackend(self.tokenizer, runner.config.vocab_size,
                                          any_whitespace=not args.constrained_json_disable_any_whitespace,
                                          stop_token_ids=eos_ids, compile_threads=args.grammar_compile_threads)
            grammar_queue = GrammarQueue(self.grammar, args.grammar_compile_timeout)
        self.core = SchedulerCore(planner, self.checker, streamer, grammar_queue, args.max_grammar_bytes,
                                  args.random_seed, self.stats, think_end_ids)
        self.watchdog = Watchdog(args.watchdog_timeout)
        self.weights = WeightsControl(runner, self.worker)
        self._flush_pending: list[int] = []  # flush requests waiting for no step in flight
        self.ctx = zmq.Context(2)
        self.recv_sock = self.detok_sock = self.reply_sock = None
        if self.is_leader:
            self.recv_sock = bind_pull(self.ctx, addrs.tokenizer_to_scheduler)
            self.detok_sock = connect_push(self.ctx, addrs.scheduler_to_detokenizer)
            self.reply_sock = connect_push(self.ctx, addrs.scheduler_to_tokenizer)

    @property
    def is_leader(self) -> bool:
        """Rank 0 (or the only rank): the one that talks to the tokenizer manager and detokenizer."""
        return self.runner.tp.rank == 0

    # -- the loop -----------------------------------------------------------------------------------
    def event_loop(self) -> None:
        core = self.core
        in_flight: ScheduleBatch | None = None
        busy = False  # the previous iteration had a step planned or in flight
        while True:
            self.watchdog.feed()
            idle = in_flight is None and not core.planner.has_work()
            if idle and busy:  # just went idle: nothing may be held now
                self._check_memory()
            waits = idle or (in_flight is None and (core.paused or core.memory_released))
            # grammars compiling: look again soon, without spinning
            self._receive(block_ms=0 if not waits else GRAMMAR_POLL_MS if core.grammar_queue else 500)
            if self.watch is not None and self.watch.parent_gone():
                self.watch.exit_orphaned()  # never keep generating for a main process that is gone
            t0 = time.perf_counter()
            continued = core.planner.chunked  # a prompt split by the last prefill step
            batch = core.plan()
            if batch is not None:
                batch.job.follows_busy_step = busy
                batch.future = self.worker.submit(batch.job)
            busy = batch is not None or in_flight is not None
            waited = self._apply(in_flight) if in_flight is not None else 0.0
            if batch is not None:  # every earlier step is applied: the matchers are current
                self._fill_grammar_mask(batch)
            in_flight = batch
            if not self.overlap and in_flight is not None:
                waited += self._apply(in_flight)
                in_flight = None
            if in_flight is None and self._flush_pending:
                self._flush_cache()
            if in_flight is None and self.weights.pending:
                for reply in self.weights.run_pending(core):
                    self._reply(reply)
            self._stream()
            if batch is not None:  # CPU time of this iteration, not counting waits for the device
                self.stats.record_step(time.perf_counter() - t0 - waited)
                self._log(batch, continued.req if continued is not None else None)

    def _apply(self, batch: ScheduleBatch) -> float:
        """Apply a finished step's results; returns how long it waited for the step to finish."""
        t0 = time.perf_counter()
        result: GenerationBatchResult = batch.future.result()  # type: ignore[union-attr]
        waited = time.perf_counter() - t0
        self.core.apply(batch, result)
        return waited

    def _check_memory(self) -> None:
        if (leak := self.kv.leak_report()) is None:
            return
        message = f"KV memory leak detected with no request running: {leak}"
        if envs.STRICT_MEM_CHECK.get():
            raise RuntimeError(message)
        logger.error(message)

    def _fill_grammar_mask(self, batch: ScheduleBatch) -> None:
        mask = batch.job.grammar_mask
        if mask is None:
            return
        t0 = time.perf_counter()
        sampling = batch.sampling_reqs
        # a finished request's sample is thrown away, and one still reasoning writes freely
        matchers = [None if (r := sampling[i]).finished or r.in_reasoning else r.grammar for i in mask.sample_indices]
        mask.fill(matchers, self.grammar, self.runner.device)  # type: ignore[union-attr]
        self.stats.record_grammar_fill(time.perf_counter() - t0, len(matchers))

    def _receive(self, block_ms: int) -> None:
        core = self.core
        msgs = []
        if self.recv_sock is not None and (not block_ms or self.recv_sock.poll(block_ms)):
            msgs = recv_all_nowait(self.recv_sock)
        # rank 0's clock decides: the other ranks' own would disagree near the deadline
        expired_rids = core.expired_rids(time.monotonic()) if self.is_leader else []
        # compile times differ across ranks: rank 0's finished compiles decide who leaves the queue
        queue = core.grammar_queue
        settled = queue.settled() if queue and self.sync and self.is_leader else ([], [])
        if self.sync is not None:  # every rank takes rank 0's messages and rank 0's clock
            msgs, expired_rids, settled = self.sync.share(msgs, expired_rids, settled)
        for msg in msgs:
            self._handle(msg)
        if queue:
            core.settle(*(queue.settle(*settled) if self.sync else queue.poll()))
        core.expire(expired_rids, self.args.request_timeout)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.core.add(msg)
        elif isinstance(msg, AbortReq):
            self.core.abort(msg.group_prefixes, msg.abort_all, msg.message)
        elif isinstance(msg, FlushCacheReq):
            if (busy := self.core.pending()) is not None:
                self._reply(FlushCacheReply(req_id=msg.req_id, success=False, message=busy))
            else:
                self._flush_pending.append(msg.req_id)  # done once no step is in flight
        elif isinstance(msg, GetServerInfoReq):
            self._reply(GetServerInfoReply(req_id=msg.req_id, info=self.server_info()))
        elif isinstance(msg, WeightsReq):
            self.weights.submit(msg, self.core)
        elif isinstance(msg, PauseReq):
            if msg.mode == "continue":
                self.core.resume()
                touched = 0
            else:
                touched = self.core.pause(msg.mode)
            self._reply(ControlReply(req_id=msg.req_id, success=True, num_paused_requests=touched))

    def _flush_cache(self) -> None:
        req_ids, self._flush_pending = self._flush_pending, []
        busy = self.core.flush_cache()  # requests may have arrived since the flush was asked for
        for req_id in req_ids:
            self._reply(FlushCacheReply(req_id=req_id, success=busy is None, message=busy or ""))

    def _stream(self) -> None:
        out = self.core.flush()
        if out is not None and self.is_leader:
            send(self.detok_sock, out)
            self.num_outputs_sent += 1

    def _reply(self, msg: Message) -> None:
        if self.is_leader:
            send(self.reply_sock, msg)

    # -- visibility ---------------------------------------------------------------------------------------
    def server_info(self) -> dict:
        alloc, max_tokens = self.runner.allocator, self.runner.max_total_tokens
        return {
            "max_total_num_tokens": max_tokens,
            "kv_slots_free": alloc.available_size(),
            "kv_slots_cached": self.kv.tree.total_size(),
            "kv_slots_used": max_tokens - alloc.available_size() - self.kv.tree.evictable_size(),
            "req_rows_free": self.kv.rows.available(),
            "req_rows_total": self.kv.rows.size,
            "num_running_reqs": self.core.planner.num_running,
            "num_queue_reqs": self.core.num_queued,
            "num_grammar_queue_reqs": len(self.core.grammar_queue or ()),
            "overlap_schedule": self.overlap,
            "paused": self.core.paused,
            "memory_released": self.runner.memory_released,
            "num_retractions": self.core.planner.num_retractions,
            "num_outputs_sent": self.num_outputs_sent,
            **({"tp_size": self.runner.tp.size, "tp_comm_s": round(self.runner.tp.comm_s, 4)}
               if self.runner.tp.size > 1 else {}),
            **(self.runner.weight_info() if self.runner.model is not None else {}),  # (released: none)
            **self.stats.info(),
        }

    def _log(self, batch: ScheduleBatch, continued: Req | None) -> None:
        """`continued`: the split prompt whose next chunk this step may run."""
        used = self.runner.max_total_tokens - self.kv.available_tokens()
        usage = used / self.runner.max_total_tokens
        planner = self.core.planner
        if batch.mode == ForwardMode.EXTEND:
            self.stats.log_prefill(len(batch.spans), batch.num_tokens, batch.cache_hits(continued), usage,
                                   len(planner.running), len(planner.waiting))
        else:
            self.stats.maybe_log_decode(len(planner.running), used, usage, len(planner.waiting), self.overlap)


def run_scheduler_process(args: ServerArgs, addrs: IPCAddresses, watch: ParentWatch, tp_rank: int = 0) -> None:
    """Entry point of the spawned scheduler process (one per tensor-parallel rank)."""
    name = "scheduler" if args.tp_size == 1 else f"scheduler TP{tp_rank}"
    setup_logging(name, args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when we stop
    if torch.device(args.resolved_device()).type == "cpu":
        keep_freed_heap()  # before any thread (zmq's, the forward worker) has an arena of its own
    ctx = zmq.Context()
    try:
        scheduler = Scheduler(args, addrs, watch, tp_rank)
    except Exception as exc:
        if isinstance(exc, ValueError):  # a setting it refused (--context-length, --tp-size): the message says it
            logger.error("scheduler failed to start: %s", exc)
        else:
            logger.exception("scheduler failed to start")
        sock = connect_push(ctx, addrs.scheduler_to_tokenizer)
        send(sock, ChildError(role="scheduler", message=f"{type(exc).__name__}: {exc}"))
        sock.close(linger=1000)
        raise SystemExit(1)
    r = scheduler.runner
    if scheduler.is_leader:
        send(scheduler.reply_sock, ReadyMsg(role="scheduler", pid=os.getpid(), max_total_tokens=r.max_total_tokens,
                                            context_len=r.context_len, vocab_size=r.config.vocab_size,
                                            max_running_requests=r.max_running_requests,
                                            architecture=r.config.arch,
                                            eos_token_ids=tuple(sorted(scheduler.checker.eos_ids))))
    scheduler.event_loop()

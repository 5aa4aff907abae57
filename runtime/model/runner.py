"""ModelRunner: owns the model, the KV pools and the attention backend; runs forward passes and sampling."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from tandem.kernels.cpu_ops import cpu_flags
from tandem.runtime.cache.pools import KVPool, ReqToTokenPool, TokenAllocator
from tandem.runtime.host_malloc import keep_freed_heap, release_freed_heap
from tandem.runtime.model.attention import create_attention_backend
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.forward_batch import ForwardBatch
from tandem.runtime.model.loader import load_config, load_model
from tandem.runtime.model_files import resolve_model_path
from tandem.runtime.model.ops import create_ops
from tandem.runtime.model import packed_linear
from tandem.runtime.model.quant import gguf_load
from tandem.runtime.model.tensor_parallel import SINGLE, TensorParallel
from tandem.runtime.model.transformers_checks import uses_transformers
from tandem.runtime.sampling.sampler import SamplingBatchInfo, sample
from tandem.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
_CPU_KV_MEM_FRACTION = 0.1  # of free host memory, when neither max_total_tokens nor a fraction is given
_GPU_KV_MEM_FRACTION = 0.85


class ModelRunner:
    def __init__(self, args: ServerArgs, tp: TensorParallel = SINGLE, pack_now: bool = True) -> None:
        """`tp`: this rank's share of a tensor-parallel job (runtime/model/tensor_parallel.py).
        `pack_now=False`: forward passes run on another thread, which calls `pack_weights` itself
        before the first one."""
        self.args, self.tp = args, tp
        self.device = torch.device(args.resolved_device())
        if self.device.type == "cpu":
            keep_freed_heap()  # a no-op where the process entry point already did it
        self.model_path = resolve_model_path(args.model_path)
        self.use_transformers = uses_transformers(args.model_impl, self.model_path)  # --model-impl
        self.dtype = self._pick_dtype()
        self.kv_dtype = self._kv_dtype()
        torch.manual_seed(0 if args.random_seed is None else args.random_seed)  # None: built directly, not launched
        self.model = self._load_target(args.quantization)
        self.config = self.model.cfg
        self.draft_model = self._load_draft_model()
        if pack_now:
            self.pack_weights()
        if self.device.type == "cpu":  # the load's transient copies (dequantized, fused, repacked): never needed again
            release_freed_heap()
        self.context_len = self._context_len()
        self.max_total_tokens = self._kv_capacity()
        self.max_running_requests = args.max_running_requests
        # twice the running limit: rows of finished requests are reused only once the step in
        # flight has been processed, so a full batch can turn over without stalling admission
        self.req_to_token_pool = ReqToTokenPool(2 * self.max_running_requests + 1, self.context_len + 8, self.device)
        self.allocator = TokenAllocator(self.max_total_tokens, self.device)
        self.kv_pool = KVPool(self.max_total_tokens, self.config.num_layers, self.config.num_kv_heads // tp.size,
                              self.config.head_dim, self.kv_dtype, self.device)
        backend = args.resolved_attention_backend()
        self.attn_backend = create_attention_backend(backend, self.kv_pool, self.req_to_token_pool,
                                                     deterministic_extend=args.enable_deterministic_inference)
        self.model.use_ops(create_ops(backend))
        self.draft_attn_backend = None
        if self.draft_model is not None:  # its own KV, in the slots the target's rows name
            dc = self.draft_model.cfg
            self.draft_kv_pool = KVPool(self.max_total_tokens, dc.num_layers, dc.num_kv_heads, dc.head_dim,
                                        self.kv_dtype, self.device)
            self.draft_attn_backend = create_attention_backend(
                backend, self.draft_kv_pool, self.req_to_token_pool,
                deterministic_extend=args.enable_deterministic_inference)
            self.draft_model.use_ops(create_ops(backend))
        weights = self.weight_info()
        logger.info("model %s loaded: %s, %d KV slots (%s), context %d, weights %s (%.1f MB)", self.model_path,
                    self.config.arch, self.max_total_tokens, str(self.kv_dtype).removeprefix("torch."), self.context_len,
                    weights["weight_quantization"], weights["weight_bytes"] / 1e6)

    def weight_info(self) -> dict:
        """What /server_info reports of the weights: how they are held ("gguf:q4_1+q8_0", or "none":
        in --dtype) and their bytes in memory (packed, quantized, or plain: each stored tensor once)."""
        from tandem.runtime.model.quant import held_label

        return {"weight_quantization": held_label(self.model),
                "weight_bytes": gguf_load.weight_bytes(self.model)}

    def pack_weights(self) -> None:
        """Linears on packed weights where this dtype and device have them (runtime/model/packed_linear.py).
        Call it on the thread that runs forward passes, under its intra-op thread count: MKL's fp32
        packs keep the threading plan of the count they were made under (packed with one thread,
        batch-64 matmuls ran on one thread: 2x slower)."""
        if packed_linear.packs_weights(self.dtype, self.device):
            packed = sum(m.pack_weights() for m in (self.model, self.draft_model) if m is not None)
            layout = ("bf16 on oneDNN" if self.dtype == torch.bfloat16
                      else "fp32 on %s (%s)" % packed_linear.fp32_layout())
            logger.info("%d linear weights packed for the CPU GEMM (%s, %d threads)", packed, layout,
                        torch.get_num_threads())

    # -- release_memory_occupation / resume_memory_occupation (tags "kv_cache", "weights") -------------
    def release_memory(self, tags: list[str]) -> None:
        """Drop the KV pools and/or the target model's weights. Call it on the forward thread with
        no request holding KV; nothing may run until `resume_memory` brings them back."""
        if "kv_cache" in tags:
            for pool in (self.kv_pool, getattr(self, "draft_kv_pool", None)):
                if pool is not None:
                    pool.release()
        if "weights" in tags:
            self.model = None  # type: ignore[assignment]

    def resume_memory(self, tags: list[str]) -> None:
        """Reallocate what `release_memory` dropped: the KV pools zeroed, the weights read again from
        the model path and packed (weights pushed since the last load from disk are not kept)."""
        if "kv_cache" in tags:
            for pool in (self.kv_pool, getattr(self, "draft_kv_pool", None)):
                if pool is not None and pool.released:
                    pool.resume()
        if "weights" in tags and self.model is None:
            self.model = self._load_target("none")
            self.model.use_ops(create_ops(self.args.resolved_attention_backend()))
            self.pack_weights()

    @property
    def memory_released(self) -> list[str]:
        """The tags whose memory is released now."""
        return [tag for tag, gone in (("kv_cache", self.kv_pool.released), ("weights", self.model is None)) if gone]

    def _pick_dtype(self) -> torch.dtype:
        if self.args.dtype != "auto" or self.device.type != "cpu":
            return _DTYPES[self.args.resolved_dtype()]
        dtype, why = pick_cpu_dtype(self._load_config())
        every_rank_bf16 = self._agree(int(dtype == torch.bfloat16))  # every rank calls it: a collective
        if dtype == torch.bfloat16 and not every_rank_bf16:
            dtype, why = torch.float32, f"{why}; bf16 not faster on every rank"
        logger.info("--dtype auto: %s (%s)", str(dtype).removeprefix("torch."), why)
        return dtype

    def _load_config(self) -> ModelConfig:
        if self.use_transformers:
            from tandem.runtime.model.transformers_checks import model_config

            return model_config(self.model_path)
        return load_config(self.model_path)

    def _load_target(self, quantization: str | None):
        """The served model: tandem's own class, or transformers' (--model-impl, transformers_impl.py)."""
        if not self.use_transformers:
            return load_model(self.model_path, self.dtype, self.device, self.tp, quantization=quantization)
        if quantization in ("gguf", "gptq", "awq", "w8a8_int8"):
            raise ValueError(f"--quantization {quantization} serves its weights through tandem's own classes, not "
                             f"with --model-impl transformers")
        from tandem.runtime.model.transformers_impl import load_transformers_model

        return load_transformers_model(self.model_path, self.dtype, self.device, self.tp)

    def _kv_dtype(self) -> torch.dtype:
        """What the KV pool stores: the model dtype, or fp8 (half of bf16's bytes, no scales): e5m2
        has fp16's exponent range and 2 mantissa bits, e4m3 3 bits and a range of +-448 (clamped),
        which attention widens as it reads."""
        if self.args.kv_cache_dtype == "auto":
            return self.dtype
        if self.args.kv_cache_dtype == "fp8_e4m3" and self.device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
            if capability < (8, 9):
                raise ValueError(f"kv_cache_dtype=fp8_e4m3 needs a GPU of compute capability 8.9 or newer (Triton "
                                 f"has no e4m3 before it; this one is {capability}); use fp8_e5m2")
        return _KV_DTYPES[self.args.kv_cache_dtype]

    def _agree(self, value: int) -> int:
        """The smallest of every rank's value: ranks plan in lockstep, so they must size alike."""
        if self.tp.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
        return int(t.item())

    def _load_draft_model(self):
        """STANDALONE speculation: the draft model, which must share the target's vocabulary."""
        path = self.args.speculative_draft_model_path
        if self.args.speculative_algorithm != "STANDALONE" or not path:
            return None
        draft = load_model(resolve_model_path(path), self.dtype, self.device)
        if draft.cfg.vocab_size != self.config.vocab_size:
            raise ValueError(f"speculative_draft_model_path {path}: vocabulary {draft.cfg.vocab_size} differs from the "
                             f"target's {self.config.vocab_size} (the draft must share the tokenizer)")
        return draft

    def _context_len(self) -> int:
        """--context-length, at most the model's own (SGLang refuses a longer one too: positions
        past what the model was trained on give garbage, not an error)."""
        limit = self.config.max_position
        asked = self.args.context_length
        if asked is not None and asked > limit:
            raise ValueError(f"--context-length {asked} is more than the model's maximum ({limit} positions)")
        return asked or limit

    def _kv_capacity(self) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        return self._agree(self._kv_capacity_here())

    def _kv_capacity_here(self) -> int:
        per_token = 0
        for cfg in (self.config, *([self.draft_model.cfg] if self.draft_model is not None else [])):
            per_token += KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads // self.tp.size, cfg.head_dim,
                                                self.kv_dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * (self.args.mem_fraction_static or _GPU_KV_MEM_FRACTION)
        else:
            budget = _free_host_bytes() * (self.args.mem_fraction_static or _CPU_KV_MEM_FRACTION)
        return max(int(budget // per_token), self.context_len)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits at batch.logits_indices, in the model's dtype."""
        return self.model(batch, self.attn_backend)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo, positions: torch.Tensor) -> torch.Tensor:
        return sample(logits, info, positions)


def _free_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def pick_cpu_dtype(cfg: ModelConfig) -> tuple[torch.dtype, str]:
    """--dtype auto on CPU: bfloat16 where the CPU has AMX-BF16 (its bf16 matmuls run ~3x fp32's),
    float32 everywhere else. A rule on the CPU's flags, never a timing: the dtype decides every
    bit of every answer, so it must be the same from start to start. (A timed choice with a
    threshold flipped between starts wherever the two dtypes ran near it, as on small models.)
    `cfg` is taken for the log. Returns the dtype and the reason."""
    flags = cpu_flags()
    shape = f"hidden {cfg.hidden_size}"
    if "amx_bf16" in flags:
        return torch.bfloat16, f"AMX-BF16 on this CPU ({shape})"
    if "avx512_bf16" in flags:
        return torch.float32, f"AVX512-BF16 without AMX: bf16 is not clearly faster ({shape})"
    return torch.float32, f"no AMX-BF16 on this CPU ({shape})"

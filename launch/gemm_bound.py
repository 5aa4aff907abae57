"""The machine's limit for a model: the time of its matmuls alone (every linear layer and the LM
head), measured on this CPU at the batch shapes a run uses, with random weights of the model's
shapes in the run's dtype, held as the model holds them (packed where it packs them). No
attention, norms, sampling or scheduling: a system's tok/s over this bound is how much of the
machine it turns into tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.kernels.cpu_ops import load_cpu_ops
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.packed_linear import (Weight, best_seconds, fp32_head, head_logits, linear, pack,
                                                packs_weights, padded_rows, weight_and_like)

PREFILL_CHUNK = 2048  # tokens per timed prefill matmul pass (tandem's default chunked prefill)


@dataclass(frozen=True)
class GemmBound:
    decode_batch: int
    decode_step_s: float  # every linear of one decode step at `decode_batch` rows, LM head included
    prefill_s_per_token: float  # the linears of one prompt token (no LM head: only last tokens need logits)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_batch / self.decode_step_s

    def seconds(self, input_tokens: int, output_tokens: int) -> float:
        """A workload at full decode batches: every prompt token once, output in batch-wide steps."""
        return input_tokens * self.prefill_s_per_token + math.ceil(output_tokens / self.decode_batch) * self.decode_step_s

    def tok_s(self, input_tokens: int, output_tokens: int) -> float:
        return output_tokens / self.seconds(input_tokens, output_tokens)


def _weights(cfg: ModelConfig, dtype: torch.dtype, num_layers: int,
             lm_head: bool = True) -> tuple[list[list[Weight]], Weight | None]:
    """Every layer's own weights (sharing one layer's would let small batches run from cache,
    which the real model, hundreds of MB of weights, never does) and the LM head as the model
    holds it (fp32_head)."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = [((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), (h, cfg.num_heads * d),
              (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)]
    held = pack if packs_weights(dtype) else (lambda w: w)
    layers = [[held(torch.randn(shape, dtype=dtype) * 0.02) for shape in shapes] for _ in range(num_layers)]
    return layers, fp32_head(torch.randn(cfg.vocab_size, h, dtype=dtype) * 0.02) if lm_head else None


def _time_pass(x: torch.Tensor, layers: list[list[Weight]], lm_head: Weight | None, repeats: int) -> float:
    """The layers' matmuls back to back, from C++ where the C++ ops are built (as tandem's CPU
    decode step calls them: timed from Python, 121 calls would add ~1 ms of Python to a 14 ms
    batch-1 bound), else from Python; the LM head from Python, as the model calls it."""
    ops = load_cpu_ops()

    def one_pass() -> None:
        if ops is not None:
            ops.layer_matmuls(x, [t for layer in layers for w in layer for t in weight_and_like(w)],
                              padded_rows(x.shape[0]))
        else:
            for layer in layers:
                qkv = linear(x, layer[0])
                linear(qkv[:, :layer[1].shape[1]].contiguous(), layer[1])
                gate_up = linear(x, layer[2])
                linear(gate_up[:, :layer[3].shape[1]].contiguous(), layer[3])
        if lm_head is not None:
            head_logits(x, lm_head)

    return best_seconds(one_pass, repeats)



def measure(cfg: ModelConfig, dtype: torch.dtype, decode_batch: int, repeats: int = 3) -> GemmBound:
    """The best of `repeats` timings (a bound: the fastest the machine did it)."""
    layers, lm_head = _weights(cfg, dtype, cfg.num_layers)
    decode_x = torch.randn(decode_batch, cfg.hidden_size, dtype=dtype)
    prefill_x = torch.randn(PREFILL_CHUNK, cfg.hidden_size, dtype=dtype)
    decode_s = _time_pass(decode_x, layers, lm_head, repeats)
    prefill_s = _time_pass(prefill_x, layers, None, max(1, repeats - 1))
    return GemmBound(decode_batch, decode_s, prefill_s / PREFILL_CHUNK)

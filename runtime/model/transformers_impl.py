"""--model-impl transformers: a causal LM that transformers builds, run through transformers'
modeling code with tandem's paged KV and attention plugged in through transformers' attention
interface (SGLang's TransformersForCausalLM in spirit).

transformers computes the embeddings, norms, MLPs and rotary; every attention layer calls
`tandem_attention` (registered as the attention implementation "tandem"), which hands the layer's
query and new K/V to the attention backend the native models use: it writes the K/V into the KV
pool at the pass's slots and attends each request over its own sequence. The batch is one packed
sequence of every request's new tokens (batch dim 1, positions from the ForwardBatch); the mask
transformers would build is skipped (a custom implementation gets none), the backend knows each
request's span. The radix cache, chunked prefill, retraction, logprobs and sampling are tandem's,
and logits come from tandem's fp32 head.

Invariant: a model is served only after a probe (`probe`) ran a short prompt, in two chunks over
a scratch KV pool, through the path that serves it (in float32: a model's semantics, not its
rounding) and got the logits transformers' own eager attention gives, with every decoder layer
attending through the interface exactly once a pass.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tandem.runtime.cache.pools import KVPool, ReqToTokenPool
from tandem.runtime.model.attention import AttentionBackend, TorchAttnBackend
from tandem.runtime.model.config import ModelConfig
from tandem.runtime.model.forward_batch import ForwardBatch, ForwardMode
from tandem.runtime.model.packed_linear import Weight, fp32_head, head_logits, pack_linears
from tandem.runtime.model.tensor_parallel import SINGLE, TensorParallel
from tandem.runtime.model.transformers_checks import check_model_class, hf_config, model_config

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "tandem"
_PROBE_TOKENS = 12
# attention kwargs that change what a layer computes beyond softmax(q k^T * scale) v over its
# causal window: tandem's backends compute none of them
_UNSUPPORTED_KWARGS = {"softcap": "attention-score softcapping", "s_aux": "attention sinks",
                       "sinks": "attention sinks"}


@dataclass
class _Pass:
    """What one forward pass's attention layers need, handed down through transformers' kwargs."""
    batch: ForwardBatch
    attn: AttentionBackend
    calls: list[tuple[int, int, int]] | None = field(default=None)  # the probe's record: (layer, kv heads, head dim)


def tandem_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface call: query [1, Hq, T, D], key and value [1, Hkv, T, D]
    (the pass's new tokens) -> [1, T, Hq, D], attended through the pass's backend at the layer
    `module.layer_idx` of the KV pool."""
    step: _Pass | None = kwargs.get("tandem_pass")
    if step is None:
        raise RuntimeError(f"{type(module).__name__} called tandem's attention without the forward batch: the model "
                           f"does not hand its kwargs down to attention")
    for name, why in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} asks for {why} ({name}), which tandem's attention does not compute")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} attends bidirectionally (is_causal is False); tandem serves causal "
                         f"attention only")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer_idx, so its K/V has no layer of the KV pool")
    if key.shape[-1] != value.shape[-1] or query.shape[-1] != key.shape[-1]:
        raise ValueError(f"{type(module).__name__}: query, key and value head sizes {query.shape[-1]}, "
                         f"{key.shape[-1]}, {value.shape[-1]} differ; tandem's KV pool holds one head size")
    if step.calls is not None:
        step.calls.append((int(layer), key.shape[1], key.shape[-1]))
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = step.attn.forward(q, k, v, int(layer), step.batch, scale, window=int(sliding_window or 0))
    return out[None], None


def register() -> None:
    """Make "tandem" an attention implementation transformers' models can be built with (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tandem_attention)


class TransformersCausalLM(nn.Module):
    """The model interface the runner and the forward worker use (hidden_states, logits,
    pack_weights, use_ops, cfg), over a transformers PreTrainedModel built with attention "tandem"."""

    def __init__(self, hf: nn.Module, cfg: ModelConfig) -> None:
        super().__init__()
        self.hf, self.cfg, self.tp = hf, cfg, SINGLE
        self.body = hf.base_model  # the decoder without its LM head
        head = hf.get_output_embeddings()
        self._head_name = next(name for name, child in hf.named_children() if child is head)
        self._head_fp32: Weight | None = None  # built from the head's weight on first use (fp32_head)

    def use_ops(self, ops: object) -> None:
        """transformers' own modules compute norms, rotary and activations: nothing to route."""

    def hidden_states(self, batch: ForwardBatch, attn: AttentionBackend,
                      calls: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """[num_tokens, hidden]: the decoder's last hidden states (after its final norm)."""
        attn.init_forward(batch)
        out = self.body(input_ids=batch.input_ids[None], position_ids=batch.positions[None], use_cache=False,
                        tandem_pass=_Pass(batch, attn, calls))
        return out[0][0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits whatever the model's dtype, as the native models' (llama.CausalLM.logits)."""
        head = self.hf.get_submodule(self._head_name)
        if self._head_fp32 is None:
            self._head_fp32 = fp32_head(head.weight)
        logits = head_logits(hidden, self._head_fp32)
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias.float()
        cap = self.cfg.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """fp32 logits at `batch.logits_indices`."""
        return self.logits(self.hidden_states(batch, attn)[batch.logits_indices])

    def pack_weights(self) -> int:
        """Every nn.Linear but the LM head on packed weights (runtime/model/packed_linear.py); the
        probe's prompt then runs once on them, so a model whose code reads a linear's weight itself
        is refused at start rather than at its first request."""
        count = pack_linears(self.hf, skip=(self._head_name,))
        self._head_fp32 = fp32_head(self.hf.get_submodule(self._head_name).weight)
        try:
            with torch.inference_mode():
                logits = _probe_tandem(self, _probe_ids(self.cfg), next(self.hf.parameters()).device)
        except (RuntimeError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"--model-impl transformers cannot serve {self.cfg.arch} on packed weights: {e}") from None
        if not bool(torch.isfinite(logits).all()):
            raise ValueError(f"--model-impl transformers cannot serve {self.cfg.arch}: non-finite logits on packed weights")
        return count + 1


def load_transformers_model(model_path: str, dtype: torch.dtype, device: torch.device | str = "cpu",
                            tp: TensorParallel = SINGLE) -> TransformersCausalLM:
    """transformers' class for the checkpoint, built with tandem's attention, its safetensors
    read under their own names; refused (ValueError naming the reason) where it cannot be served."""
    if tp.size > 1:
        raise ValueError(f"--model-impl transformers runs on one rank; --tp-size {tp.size} needs one of tandem's own "
                         f"model classes")
    config = hf_config(model_path)
    cfg = model_config(model_path, config)
    model_class = _causal_lm_class(config)
    check_model_class(model_class)
    register()
    hf, info = model_class.from_pretrained(model_path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                                           use_safetensors=True, output_loading_info=True)
    _check_loading(model_path, info)
    model = TransformersCausalLM(hf.to(device).eval(), cfg)
    with _widened(hf):
        probe(model)
    model._head_fp32 = None  # made from the widened head: made again from the served one
    logger.info("--model-impl transformers: %s from transformers, attention through tandem's backends",
                model_class.__name__)
    return model


def _causal_lm_class(config: Any) -> type:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"transformers has no causal LM class for model type {config.model_type!r}") from None


def _check_loading(model_path: str, info: dict) -> None:
    """A weight the checkpoint lacks would be left random, one it has that the model does not use
    would change nothing: either is a wrong model, refused."""
    for key, what in (("missing_keys", "lacks weights"), ("unexpected_keys", "has weights the model does not use"),
                      ("mismatched_keys", "has weights of the wrong shape")):
        names = sorted(str(n) for n in info.get(key) or ())
        if names:
            raise ValueError(f"{model_path}: checkpoint {what}: {names[:5]}{' ...' if len(names) > 5 else ''}")


@contextlib.contextmanager
def _widened(hf: nn.Module) -> Iterator[None]:
    """The model in float32 for the block, then each parameter and buffer back in its own dtype
    (bf16 and fp16 widen and narrow back exactly). In 16 bits a probe would compare rounding: one
    position of SmolLM2-135M in bf16 differs by 38 between transformers' eager and sdpa attention."""
    dtypes = {name: t.dtype for name, t in (*hf.named_parameters(), *hf.named_buffers())}
    hf.float()
    try:
        yield
    finally:
        for name, t in (*hf.named_parameters(), *hf.named_buffers()):
            t.data = t.data.to(dtypes[name])


def _probe_ids(cfg: ModelConfig) -> torch.Tensor:
    return (torch.arange(_PROBE_TOKENS, dtype=torch.int64) * 7919 + 3) % cfg.vocab_size


@torch.inference_mode()
def probe(model: TransformersCausalLM) -> None:
    """Refuse (ValueError) a model that tandem's path would not answer as transformers does: run
    `_PROBE_TOKENS` tokens as a prefill of half and an extend over it as a cached prefix, through
    a scratch pool and the torch backend, and compare with transformers' eager attention."""
    cfg, hf = model.cfg, model.hf
    device = next(hf.parameters()).device
    ids = _probe_ids(cfg)
    hf.set_attn_implementation("eager")
    try:
        want = hf(input_ids=ids[None].to(device), use_cache=False).logits[0].float()
    finally:
        hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        got = _probe_tandem(model, ids, device)
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--model-impl transformers cannot serve {cfg.arch}: {e}") from None
    # in fp32 the two attentions differ by summation order only (~1e-5 on SmolLM2's logits of ~35);
    # a missing logit scale or transform moves them by units
    tol = 1e-3 * (1.0 + want.abs().max().item())
    diff = (got - want).abs().max().item()
    if not diff <= tol:
        raise ValueError(f"--model-impl transformers cannot serve {cfg.arch}: its logits through tandem's attention "
                         f"and head differ from transformers' own by {diff:.3g} (> {tol:.3g}): it computes something "
                         f"past attention and the LM head (a mask, a logit scale) that tandem does not")


def _probe_tandem(model: TransformersCausalLM, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    cfg, n = model.cfg, len(ids)
    dtype = next(model.hf.parameters()).dtype
    pool = ReqToTokenPool(1, n, device)
    row = pool.alloc()
    pool.req_to_token[row, :n] = torch.arange(n)
    attn = TorchAttnBackend(KVPool(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device), pool)
    logits, split = [], n // 2
    for start, length in ((0, split), (split, n - split)):
        calls: list[tuple[int, int, int]] = []
        batch = ForwardBatch.build(ForwardMode.EXTEND, ids[start:start + length], [row], [start], [length],
                                   torch.arange(start, start + length), list(range(length)), device)
        logits.append(model.logits(model.hidden_states(batch, attn, calls)))
        _check_calls(cfg, calls)
    return torch.cat(logits)


def _check_calls(cfg: ModelConfig, calls: list[tuple[int, int, int]]) -> None:
    """Every layer attends through the interface once a pass, with the K/V shape the pool holds."""
    layers = sorted(layer for layer, _, _ in calls)
    if layers != list(range(cfg.num_layers)):
        missing = sorted(set(range(cfg.num_layers)) - set(layers))
        raise ValueError(f"its {cfg.num_layers} layers do not each attend once through transformers' attention "
                         f"interface (layers attending: {layers}; without: {missing}): recurrent, state-space or "
                         f"other layers keep state outside tandem's KV cache")
    shapes = {(heads, dim) for _, heads, dim in calls}
    if shapes != {(cfg.num_kv_heads, cfg.head_dim)}:
        raise ValueError(f"its layers hand over K/V of (heads, head size) {sorted(shapes)}, not the config's "
                         f"({cfg.num_kv_heads}, {cfg.head_dim})")

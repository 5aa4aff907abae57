"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seed.

Randomness is counter-based: the noise for (seed, position, token id) is a hash of the three, so
a seeded request samples the same tokens whatever else shares its batch. Unseeded requests get
a random seed when they are created, which keeps one code path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.cpu_ops import load_cpu_ops
from tandem.runtime.sampling.params import GREEDY_TEMPERATURE

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatchInfo:
    # [B] float32: each request's temperature, 1.0 where it is below 1e-6 (SGLang: temperature 0 is
    # temperature 1 + top-k 1). Greedy rows are flagged in is_greedy and take the argmax whatever
    # their temperature; output logprobs divide by it (forward_worker.py)
    temperatures: torch.Tensor
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size where unset
    min_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64, the whole 64-bit seed
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    need_top_p_k: bool
    need_min_p: bool

    @staticmethod
    def build(temperatures: list[float], top_ps: list[float], top_ks: list[int], min_ps: list[float],
              seeds: list[int], vocab_size: int, device: torch.device | str = "cpu") -> "SamplingBatchInfo":
        greedy = [t < GREEDY_TEMPERATURE or k == 1 for t, k in zip(temperatures, top_ks)]
        ks = [vocab_size if (k is None or k < 0 or k > vocab_size) else k for k in top_ks]
        temps = [1.0 if t < GREEDY_TEMPERATURE else t for t in temperatures]
        return SamplingBatchInfo(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            need_top_p_k=any(p < 1.0 for p in top_ps) or any(k < vocab_size for k in ks),
            need_min_p=any(p > 0.0 for p in min_ps),
        )

    def take(self, index: torch.Tensor) -> "SamplingBatchInfo":
        """The settings of rows `index` (a verify samples several positions per request)."""
        return SamplingBatchInfo(
            temperatures=self.temperatures[index], top_ps=self.top_ps[index], top_ks=self.top_ks[index],
            min_ps=self.min_ps[index], seeds=self.seeds[index], is_greedy=self.is_greedy[index],
            all_greedy=self.all_greedy, need_top_p_k=self.need_top_p_k, need_min_p=self.need_min_p)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, read in the logits' own dtype: widening to float32 is exact and
    keeps order, so these are the float32 logits' ids, without a float32 copy of them."""
    if logits.device.type == "cpu" and (ops := load_cpu_ops()) is not None:
        return ops.greedy_ids(logits.contiguous())
    # max(dim).indices: argmax's first-maximum ids, at ~2x its speed where argmax does not vectorize
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, info: SamplingBatchInfo, positions: torch.Tensor) -> torch.Tensor:
    """logits [B, V] in any float dtype (sampled in float32); positions [B] is the position each
    sampled token will take. Returns [B] int64."""
    greedy = greedy_ids(logits)
    if info.all_greedy:
        return greedy
    logits = logits.float()
    probs = torch.softmax(_scaled(logits, info.temperatures), dim=-1)
    noise = _exponential_noise(info.seeds, positions, logits.shape[1])
    if info.need_top_p_k or info.need_min_p:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
        keep = _keep_mask(sorted_probs, info)
        race = torch.where(keep, sorted_probs / noise.gather(1, sorted_ids), torch.zeros_like(sorted_probs))
        sampled = sorted_ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    else:
        sampled = (probs / noise).argmax(dim=-1)
    return torch.where(info.is_greedy, greedy, sampled)


def _scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits / temperature, +inf capped at float32's maximum: a logit_bias near that maximum
    divided by a temperature below 1 overflows, and softmax over an inf is NaN, whose argmax is
    token 0 instead of the biased token. The cap is an in-place pass on the fresh quotient (a
    max-shift would add a reduction over the vocabulary to every sampled step); -inf, the masks'
    value, stays."""
    return (logits / temperatures[:, None]).clamp_(max=torch.finfo(torch.float32).max)


def _keep_mask(sorted_probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    ranks = torch.arange(sorted_probs.shape[1], device=sorted_probs.device)[None, :]
    keep = ranks < info.top_ks[:, None]
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above this token
    keep &= cum_before < info.top_ps[:, None]
    keep &= sorted_probs >= info.min_ps[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True  # the most likely token always survives
    return keep


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on 32-bit values held in int64 (products wrap; the low 32 bits stay exact)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise per (row, token); argmax(p / noise) samples from p (the exponential race)."""
    # both halves of the 64-bit seed feed the key: seeds that differ only above bit 31 differ
    seed_key = _fmix32(_fmix32((seeds & _MASK32) ^ 0x5BD1E995) ^ ((seeds >> 32) & _MASK32))
    row_key = _fmix32(seed_key ^ (positions.to(torch.int64) & _MASK32))
    token_ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _fmix32(row_key[:, None] ^ ((token_ids[None, :] * 0x27D4EB2F) & _MASK32))
    uniform = (bits.to(torch.float64) + 0.5) / 4294967296.0
    return (-torch.log(uniform)).to(torch.float32)

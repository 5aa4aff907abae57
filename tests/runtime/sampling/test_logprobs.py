"""Device-side logprobs: chunked computation against a plain log_softmax reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.runtime.sampling.logprobs import (
    InputLogprobAccumulator,
    LogprobChunk,
    batch_output_logprobs,
    compute_logprobs,
    compute_logprobs_from_hidden,
)

V = 97


def _reference(logits: torch.Tensor, ids: torch.Tensor, k: int, req: list[int]):
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = torch.topk(lp, k, dim=-1)
    return lp.gather(1, ids[:, None]).squeeze(1), vals, idx, lp[:, req]


@pytest.mark.parametrize("chunk_size", [1024, 7, 1])
def test_matches_log_softmax(chunk_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(33, V, generator=g) * 3
    ids = torch.randint(0, V, (33,), generator=g)
    req = [0, 5, 96]
    out = compute_logprobs(logits, ids, 4, req, chunk_size=chunk_size)
    tok, vals, idx, ids_lp = _reference(logits, ids, 4, req)
    torch.testing.assert_close(out.token_logprobs, tok)
    torch.testing.assert_close(out.top_vals, vals)
    assert torch.equal(out.top_idx, idx.to(torch.int32))
    torch.testing.assert_close(out.ids_logprobs, ids_lp)
    assert out.token_logprobs.dtype == torch.float32 and out.top_idx.dtype == torch.int32


def test_half_precision_logits_are_computed_in_float32() -> None:
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.arange(8)
    out = compute_logprobs(logits, ids, 2, None, chunk_size=3)
    tok, vals, _, _ = _reference(logits, ids, 2, [])
    assert out.top_vals.dtype == torch.float32
    torch.testing.assert_close(out.token_logprobs, tok)
    torch.testing.assert_close(out.top_vals, vals)


def test_memory_bound_chunks_rows() -> None:
    # The LM head sees at most chunk_size rows at a time, so neither the logits nor their
    # float32 log-softmax exist for all N rows at once: working memory is O(chunk x V).
    hidden = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    weight = torch.randn(V, 16, generator=torch.Generator().manual_seed(3))
    seen: list[int] = []

    def lm_head(h: torch.Tensor) -> torch.Tensor:
        seen.append(h.shape[0])
        return h @ weight.T

    ids = torch.randint(0, V, (64,))
    out = compute_logprobs_from_hidden(hidden, lm_head, ids, 3, [1, 2], chunk_size=4)
    assert max(seen) == 4 and sum(seen) == 64
    tok, vals, idx, ids_lp = _reference(hidden @ weight.T, ids, 3, [1, 2])
    torch.testing.assert_close(out.token_logprobs, tok)
    torch.testing.assert_close(out.top_vals, vals)
    assert torch.equal(out.top_idx, idx.to(torch.int32))
    torch.testing.assert_close(out.ids_logprobs, ids_lp)


def test_no_token_ids_gives_nan_and_k_is_clamped() -> None:
    out = compute_logprobs(torch.randn(3, 5), None, 9, None)
    assert torch.isnan(out.token_logprobs).all()
    assert out.top_vals.shape == (3, 5) and out.ids_logprobs.shape == (3, 0)


def test_empty_and_bad_ids() -> None:
    out = compute_logprobs(torch.randn(0, V), torch.zeros(0, dtype=torch.long), 2, [1])
    assert len(out) == 0 and out.top_vals.shape == (0, 2) and out.ids_logprobs.shape == (0, 1)
    with pytest.raises(ValueError, match="token_ids_logprob"):
        compute_logprobs(torch.randn(2, V), None, 0, [V])


def _prompt_logits(p: int, seed: int = 4) -> tuple[np.ndarray, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (p,), generator=g).numpy(), torch.randn(p, V, generator=g)


def test_accumulator_three_chunks_equals_one_shot() -> None:
    prompt, logits = _prompt_logits(20)
    one = InputLogprobAccumulator(prompt, 0, 3, [4, 7])
    one.add_logits(logits, 0)
    split = InputLogprobAccumulator(prompt, 0, 3, [4, 7], chunk_size=2)
    for lo, hi in [(0, 6), (6, 13), (13, 20)]:
        assert not split.done
        split.add_logits(logits[lo:hi], lo)
    assert split.done
    a, b = one.finalize(), split.finalize()
    assert a.null_prefix == b.null_prefix == 1 and len(a) == 20
    for f in ("token_logprobs", "top_vals", "top_idx", "ids_logprobs", "token_ids"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_accumulator_position_convention() -> None:
    prompt, logits = _prompt_logits(10)
    acc = InputLogprobAccumulator(prompt, 0, 2)
    acc.add_logits(logits, 0)
    out = acc.finalize()
    lp = torch.log_softmax(logits, -1).numpy()
    assert np.isnan(out.token_logprobs[0]) and (out.top_idx[0] == -1).all()
    np.testing.assert_array_equal(out.token_ids, prompt.astype(np.int32))
    # position i is predicted by logits row i-1
    np.testing.assert_allclose(out.token_logprobs[1:], lp[np.arange(9), prompt[1:]], rtol=1e-5)


def test_accumulator_start_len_and_precomputed_chunks() -> None:
    prompt, logits = _prompt_logits(12)
    acc = InputLogprobAccumulator(prompt, 5, 2)
    # position 5 is reported as None (SGLang pads the first entry), so row 4 is not needed
    assert acc.rows_needed == range(5, 11)
    nxt = torch.from_numpy(prompt[1:])
    for lo, hi in [(0, 7), (7, 12)]:  # rows outside rows_needed are ignored
        chunk = compute_logprobs(logits[lo:hi], torch.cat([nxt, nxt[:1]])[lo:hi], 2)
        acc.add_chunk(chunk, lo)
    out = acc.finalize()
    assert out.null_prefix == 1 and len(out) == 7
    np.testing.assert_array_equal(out.token_ids, prompt[5:].astype(np.int32))
    assert np.isnan(out.token_logprobs[0]) and (out.top_idx[0] == -1).all()
    ref = torch.log_softmax(logits, -1).numpy()[np.arange(5, 11), prompt[6:]]
    np.testing.assert_allclose(out.token_logprobs[1:], ref, rtol=1e-5)


@pytest.mark.parametrize("start", [0, 1, 4, 9])
def test_accumulator_first_reported_entry_is_none_whatever_the_start(start: int) -> None:
    # SGLang's add_input_logprob_return_values always pads the first input entry with None:
    # positions [start, P) get P - start entries, and row start - 1 is never computed
    prompt, logits = _prompt_logits(10)
    acc = InputLogprobAccumulator(prompt, start, 3, [2])
    assert acc.rows_needed == range(start, 9) and acc.next_row == start
    acc.add_logits(logits, 0)
    out = acc.finalize()
    assert len(out) == 10 - start and out.null_prefix == 1
    assert np.isnan(out.token_logprobs[0]) and np.isnan(out.ids_logprobs[0]).all()
    np.testing.assert_array_equal(out.token_ids, prompt[start:].astype(np.int32))
    ref = torch.log_softmax(logits, -1).numpy()
    np.testing.assert_allclose(out.token_logprobs[1:], ref[np.arange(start, 9), prompt[start + 1:]], rtol=1e-5)
    np.testing.assert_allclose(out.ids_logprobs[1:, 0], ref[start:9, 2], rtol=1e-5)


def test_accumulator_last_prompt_token_alone_needs_no_rows() -> None:
    # a request's default start (-1) becomes P-1 (LogprobParams.input_start): one None entry
    prompt, _ = _prompt_logits(6)
    acc = InputLogprobAccumulator(prompt, 5, 2, [3])
    assert acc.done and len(acc.rows_needed) == 0
    out = acc.finalize()
    assert len(out) == 1 and out.null_prefix == 1 and out.token_ids.tolist() == [prompt[5]]
    assert out.top_vals.shape == (1, 2) and out.ids_logprobs.shape == (1, 1)


def test_accumulator_edges() -> None:
    prompt, logits = _prompt_logits(6)
    none = InputLogprobAccumulator(prompt, -1, 2)
    assert none.done and len(none.finalize()) == 0
    single = InputLogprobAccumulator(prompt[:1], 0, 2)
    out = single.finalize()
    assert single.done and len(out) == 1 and out.null_prefix == 1 and out.top_vals.shape == (1, 2)
    acc = InputLogprobAccumulator(prompt, 0, 2)
    with pytest.raises(ValueError, match="skipped"):
        acc.add_logits(logits[2:], 2)
    with pytest.raises(ValueError, match="incomplete"):
        acc.finalize()


def test_chunk_to_arrays_blanks_null_prefix() -> None:
    chunk = compute_logprobs(torch.randn(4, V), torch.arange(4), 2, [3])
    arrays = chunk.to_arrays(np.arange(4), null_prefix=1)
    assert arrays.null_prefix == 1 and np.isnan(arrays.ids_logprobs[0]).all()
    assert not np.isnan(arrays.top_vals[1:]).any()
    assert len(LogprobChunk.cat([chunk, chunk.slice(1, 3)])) == 6


def test_batch_output_logprobs_per_row_k_and_ids() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6))
    sampled = torch.tensor([1, 2, 3])
    rows = batch_output_logprobs(logits, sampled, [0, 2, 5], [None, [7], [9, 4]])
    lp = torch.log_softmax(logits, -1).numpy()
    assert [r.top_vals.shape for r in rows] == [(1, 0), (1, 2), (1, 5)]
    assert [r.ids_logprobs.shape for r in rows] == [(1, 0), (1, 1), (1, 2)]
    np.testing.assert_allclose(rows[2].ids_logprobs[0], lp[2, [9, 4]], rtol=1e-5)
    np.testing.assert_allclose([r.token_logprobs[0] for r in rows], lp[[0, 1, 2], [1, 2, 3]], rtol=1e-5)
    assert rows[1].token_ids.tolist() == [2] and rows[1].top_idx[0, 0] == lp[1].argmax()


def test_temperatures_scale_rows_and_masked_tokens_read_the_float32_floor() -> None:
    # output logprobs: log(softmax(logits / t)) clamped to float32's minimum, as SGLang's sampler
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(7)) * 2
    logits[1, [0, 5]] = float("-inf")  # masked (a grammar, a min-new-tokens ban)
    temps = torch.tensor([0.5, 1.0, 2.0, 0.7])
    sampled = torch.tensor([3, 5, 8, 1])
    rows = batch_output_logprobs(logits, sampled, [V, 2, 2, 0], [[0, 5], [5, 0], None, None],
                                 chunk_size=3, temperatures=temps)
    floor = torch.finfo(torch.float32).min
    ref = torch.log(torch.softmax(logits / temps[:, None], -1)).clamp(min=floor).numpy()
    np.testing.assert_allclose([r.token_logprobs[0] for r in rows], ref[[0, 1, 2, 3], [3, 5, 8, 1]], rtol=1e-5)
    assert rows[1].token_logprobs[0] == floor and rows[1].ids_logprobs[0].tolist() == [floor, floor]
    assert rows[0].top_vals.shape == (1, V) and np.isfinite(rows[0].top_vals).all()
    np.testing.assert_allclose(rows[2].top_vals[0], np.sort(ref[2])[::-1][:2], rtol=1e-5)
    unscaled = batch_output_logprobs(logits, sampled, [0] * 4, [None] * 4)  # None: as they are
    plain = torch.log_softmax(logits, -1).clamp(min=floor).numpy()
    np.testing.assert_allclose([r.token_logprobs[0] for r in unscaled], plain[[0, 1, 2, 3], [3, 5, 8, 1]], rtol=1e-5)


def test_a_logit_bias_near_float32s_maximum_has_logprob_zero_under_a_temperature_below_one() -> None:
    # logit / 0.5 would be inf and its log-softmax NaN (a null logprob on the wire)
    logits = torch.zeros(1, V)
    logits[0, 3] = 3e38
    row = batch_output_logprobs(logits, torch.tensor([3]), [1], [None], temperatures=torch.tensor([0.5]))[0]
    assert row.token_logprobs[0] == 0.0 and row.top_vals[0, 0] == 0.0

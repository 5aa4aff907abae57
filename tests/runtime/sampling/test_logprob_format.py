"""Host-side logprob formatting: nested triples, flat and flat+b64, fallback, stream cache."""
from __future__ import annotations

import base64
import logging

import numpy as np
import orjson
import pytest

from tandem.ipc.messages import LogprobArrays
from tandem.runtime.sampling.logprob_format import (
    LogprobFormatOptions,
    LogprobFormatter,
    decode_flat_top,
    encode_json,
    flat_top_fields,
)


def _arrays(m: int, k: int = 2, null_prefix: int = 0, seed: int = 0, n_ids: int = 0) -> LogprobArrays:
    rng = np.random.default_rng(seed)
    vals = -np.sort(rng.random((m, k), dtype=np.float32) * 5, axis=1)
    arrays = LogprobArrays(
        token_logprobs=vals[:, 0].copy(), token_ids=rng.integers(0, 1000, m).astype(np.int32), top_vals=vals,
        top_idx=rng.integers(0, 1000, (m, k)).astype(np.int32),
        ids_logprobs=-rng.random((m, n_ids), dtype=np.float32), null_prefix=null_prefix,
    )
    arrays.token_logprobs[:null_prefix] = np.nan
    arrays.top_vals[:null_prefix] = np.nan
    arrays.top_idx[:null_prefix] = -1
    arrays.ids_logprobs[:null_prefix] = np.nan
    return arrays


def _meta(opts: LogprobFormatOptions, inp: LogprobArrays, out: LogprobArrays | None = None,
          decode=None) -> dict:
    f = LogprobFormatter(opts, decode)
    f.extend_input(inp)
    if out is not None:
        f.extend_output(out)
    return f.meta_info()


def test_nested_triples_and_null_first_position() -> None:
    inp = _arrays(4, null_prefix=1, n_ids=2)
    opts = LogprobFormatOptions(top_logprobs_num=2, token_ids_logprob=(3, 9))
    meta = _meta(opts, inp, _arrays(3, seed=1, n_ids=2))
    tok = meta["input_token_logprobs"]
    assert tok[0] == (None, int(inp.token_ids[0]), None)
    assert tok[1] == (float(inp.token_logprobs[1]), int(inp.token_ids[1]), None)
    assert meta["input_top_logprobs"][0] is None
    assert meta["input_top_logprobs"][2] == [
        (float(inp.top_vals[2, j]), int(inp.top_idx[2, j]), None) for j in range(2)]
    assert meta["input_token_ids_logprobs"][0] is None
    assert [t[1] for t in meta["input_token_ids_logprobs"][1]] == [3, 9]
    assert len(meta["output_token_logprobs"]) == 3 and meta["output_top_logprobs"][0] is not None
    assert not any("flat" in key for key in meta)
    orjson.loads(orjson.dumps(meta))  # JSON-able as is


def test_text_in_logprobs_uses_decode_callback() -> None:
    def decode(ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]

    inp = _arrays(3, null_prefix=1)
    opts = LogprobFormatOptions(top_logprobs_num=2, return_text_in_logprobs=True)
    meta = _meta(opts, inp, decode=decode)
    assert meta["input_token_logprobs"][0][2] == f"<{inp.token_ids[0]}>"
    assert meta["input_top_logprobs"][1][1][2] == f"<{inp.top_idx[1, 1]}>"
    # Without the flag the callback is ignored.
    plain = _meta(LogprobFormatOptions(top_logprobs_num=2), inp, decode=decode)
    assert plain["input_token_logprobs"][0][2] is None


@pytest.mark.parametrize("b64", [False, True])
def test_flat_matches_nested_and_index_formula(b64: bool) -> None:
    inp = _arrays(6, k=3, null_prefix=1)
    nested = _meta(LogprobFormatOptions(top_logprobs_num=3), inp)
    opts = LogprobFormatOptions(top_logprobs_num=3, flat_input_top=True, flat_b64=b64)
    meta = orjson.loads(orjson.dumps(_meta(opts, inp)))
    assert "input_top_logprobs" not in meta and meta["input_top_logprobs_shape"] == [5, 3]
    assert meta["input_top_logprobs_null_prefix"] == 1
    assert ("input_top_logprobs_val_flat_b64" in meta) == b64
    assert ("input_top_logprobs_val_flat" in meta) == (not b64)
    vals, idx, prefix = decode_flat_top(meta, "input")
    rows, k = meta["input_top_logprobs_shape"]
    flat_v, flat_i = vals.reshape(-1), idx.reshape(-1)
    for i in range(prefix, prefix + rows):
        for j in range(k):
            v, t, _ = nested["input_top_logprobs"][i][j]
            assert np.float32(v) == flat_v[(i - prefix) * k + j] and t == flat_i[(i - prefix) * k + j]
    assert meta["input_token_logprobs"] == orjson.loads(orjson.dumps(nested["input_token_logprobs"]))


def test_b64_decodes_with_numpy_exactly() -> None:
    inp = _arrays(5, null_prefix=1)
    meta = _meta(LogprobFormatOptions(top_logprobs_num=2, flat_input_top=True, flat_b64=True), inp)
    assert meta["input_top_logprobs_val_flat_b64_dtype"] == "float32"
    assert meta["input_top_logprobs_idx_flat_b64_dtype"] == "int32"
    shape = meta["input_top_logprobs_shape"]
    v = np.frombuffer(base64.b64decode(meta["input_top_logprobs_val_flat_b64"]), "float32")
    i = np.frombuffer(base64.b64decode(meta["input_top_logprobs_idx_flat_b64"]), "int32")
    np.testing.assert_array_equal(v.reshape(shape), inp.top_vals[1:])
    np.testing.assert_array_equal(i.reshape(shape), inp.top_idx[1:])


def test_all_null_rows_give_empty_shape() -> None:
    fields = flat_top_fields("input", np.full((1, 2), np.nan, np.float32),
                             np.full((1, 2), -1, np.int32), 1)
    assert fields["input_top_logprobs_shape"] == [0, 2]
    assert fields["input_top_logprobs_null_prefix"] == 1
    assert fields["input_top_logprobs_val_flat"] == [] == fields["input_top_logprobs_idx_flat"]
    meta = _meta(LogprobFormatOptions(top_logprobs_num=2, flat_input_top=True), _arrays(1, null_prefix=1))
    assert meta["input_top_logprobs_shape"] == [0, 2]


@pytest.mark.parametrize("start", [0, 3, 5])
@pytest.mark.parametrize("flat,b64", [(False, False), (True, False), (True, True)])
def test_prompt_entries_from_any_start_lead_with_one_none(start: int, flat: bool, b64: bool) -> None:
    # SGLang pads the first input entry with None whatever logprob_start_len is (5 = P-1: the
    # default -1 of a generating request); flat formats count it in the null prefix
    import torch

    from tandem.runtime.sampling.logprobs import InputLogprobAccumulator

    prompt = np.arange(10, 16)
    acc = InputLogprobAccumulator(prompt, start, 2, [4])
    acc.add_logits(torch.randn(6, 32, generator=torch.Generator().manual_seed(start)), 0)
    opts = LogprobFormatOptions(top_logprobs_num=2, token_ids_logprob=(4,), flat_input_top=flat, flat_b64=b64)
    meta = orjson.loads(orjson.dumps(_meta(opts, acc.finalize())))
    tok = meta["input_token_logprobs"]
    assert [t[1] for t in tok] == prompt[start:].tolist() and tok[0][0] is None
    assert all(t[0] is not None for t in tok[1:])
    assert meta["input_token_ids_logprobs"][0] is None
    if flat:
        vals, idx, null_prefix = decode_flat_top(meta)
        assert null_prefix == 1 and vals.shape == idx.shape == (len(tok) - 1, 2)
    else:
        assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(tok)


def test_flat_output_side_and_json_arrays() -> None:
    opts = LogprobFormatOptions(top_logprobs_num=2, flat_output_top=True, json_arrays=True)
    meta = _meta(opts, _arrays(3, null_prefix=1), _arrays(4, seed=2))
    assert "input_top_logprobs" in meta and "output_top_logprobs" not in meta
    assert isinstance(meta["output_top_logprobs_val_flat"], np.ndarray)
    decoded = orjson.loads(encode_json(meta))
    assert decoded["output_top_logprobs_shape"] == [4, 2]
    assert decoded["output_top_logprobs_null_prefix"] == 0
    vals, _, _ = decode_flat_top(decoded, "output")
    assert vals.shape == (4, 2)


def test_irregular_rows_fall_back_to_nested(caplog: pytest.LogCaptureFixture) -> None:
    opts = LogprobFormatOptions(top_logprobs_num=2, flat_input_top=True, flat_b64=True)
    # A null row after real rows cannot be expressed by a leading null prefix.
    f = LogprobFormatter(opts, rid="r1")
    f.extend_input(_arrays(3, null_prefix=1))
    f.extend_input(_arrays(2, null_prefix=1, seed=3))
    with caplog.at_level(logging.WARNING):
        meta = f.meta_info()
    assert "input_top_logprobs" in meta and not any("flat" in key for key in meta)
    assert meta["input_top_logprobs"][3] is None and len(meta["input_top_logprobs"]) == 5
    assert "after the leading null prefix" in f.fallback_reasons["input"]
    assert "r1" in caplog.text
    # Rows of different widths are not rectangular.
    g = LogprobFormatter(opts)
    g.extend_input(_arrays(2, k=2))
    g.extend_input(_arrays(2, k=3))
    assert "input_top_logprobs" in g.meta_info()
    assert "rectangular" in g.fallback_reasons["input"]


def test_fallback_after_flat_was_sent_rebuilds_nested_tops() -> None:
    f = LogprobFormatter(LogprobFormatOptions(top_logprobs_num=2, flat_input_top=True))
    f.extend_input(_arrays(3, null_prefix=1))
    assert "input_top_logprobs_shape" in f.meta_info()
    f.extend_input(_arrays(2, null_prefix=1, seed=5))
    meta = f.meta_info()
    assert len(meta["input_top_logprobs"]) == 5 and len(meta["input_token_logprobs"]) == 5


def test_streaming_cache_appends_and_reuses() -> None:
    opts = LogprobFormatOptions(top_logprobs_num=2, flat_input_top=True, flat_b64=True)
    f = LogprobFormatter(opts)
    f.extend_input(_arrays(4, null_prefix=1))
    outs = [_arrays(1, seed=s) for s in range(3)]
    f.extend_output(outs[0])
    first = f.meta_info()
    f.extend_output(outs[1])
    f.extend_output(outs[2])
    second = f.meta_info()
    third = f.meta_info()
    # Input side unchanged: the same built objects come back, nothing rebuilt.
    assert second["input_token_logprobs"] is first["input_token_logprobs"]
    assert second["input_top_logprobs_val_flat_b64"] is first["input_top_logprobs_val_flat_b64"]
    # Output side grew; an earlier dict is a snapshot and does not change under its reader.
    assert len(first["output_token_logprobs"]) == 1 and len(second["output_token_logprobs"]) == 3
    assert third["output_top_logprobs"] is second["output_top_logprobs"]
    one_shot = LogprobFormatter(opts)
    one_shot.extend_input(_arrays(4, null_prefix=1))
    for o in outs:
        one_shot.extend_output(o)
    assert orjson.dumps(one_shot.meta_info()) == orjson.dumps(third)


def test_output_token_logprobs_length_counts_the_output_entries() -> None:
    # SGLang's add_logprob_to_meta_info sets it on every response and stream chunk
    f = LogprobFormatter(LogprobFormatOptions())
    f.extend_input(_arrays(3, null_prefix=1))
    assert f.meta_info()["output_token_logprobs_length"] == 0
    f.extend_output(_arrays(2, seed=1))
    f.extend_output(_arrays(1, seed=2))
    meta = f.meta_info()
    assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"]) == 3
    assert "input_token_logprobs_length" not in meta

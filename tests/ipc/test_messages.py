"""Message structs: tagged-union config, field contracts and helpers."""
from __future__ import annotations

import gc

import msgspec
import numpy as np
import pytest

from tandem.ipc import messages as m
from tandem.ipc.codec import WireError, decode, encode
from tandem.runtime.sampling.params import SamplingParams


def _req(**kw: object) -> m.TokenizedGenerateReq:
    base: dict[str, object] = dict(
        rid="a", input_ids=[1, 2, 3], sampling_params=SamplingParams(), stream=False,
    )
    base.update(kw)
    return m.TokenizedGenerateReq(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", m.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_every_message_is_a_tagged_gc_free_struct(cls: type) -> None:
    cfg = cls.__struct_config__
    assert issubclass(cls, msgspec.Struct)
    assert cfg.tag == cls.__name__ and cfg.tag_field == "type"
    assert cfg.gc is False


@pytest.mark.parametrize("cls", m.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_every_message_is_keyword_only(cls: type) -> None:
    if cls.__struct_fields__:
        with pytest.raises(TypeError):
            cls("positional")


def test_union_lists_each_message_once() -> None:
    names = [t.__name__ for t in m.MESSAGE_TYPES]
    assert len(names) == len(set(names)) == 13
    assert "FinishReason" not in names  # nested only, never top-level


def test_gc_free_instances_are_not_tracked() -> None:
    assert not gc.is_tracked(m.AbortReq(group_prefixes=["x_"]))


def test_sampling_params_is_the_runtime_struct() -> None:
    assert m.TokenizedGenerateReq.__annotations__["sampling_params"] in (
        SamplingParams, "SamplingParams",
    )
    out = decode(encode(_req(sampling_params=SamplingParams(top_k=5))))
    assert isinstance(out.sampling_params, SamplingParams) and out.sampling_params.top_k == 5


def test_input_ids_are_coerced_to_int32() -> None:
    req = _req(input_ids=[1, 2, 3])
    assert isinstance(req.input_ids, np.ndarray) and req.input_ids.dtype == np.int32
    ids = np.arange(3, dtype=np.int32)
    assert _req(input_ids=ids).input_ids is ids  # no copy when already int32


def test_2d_input_ids_are_rejected_on_build_and_decode() -> None:
    with pytest.raises(ValueError, match="1-D"):
        _req(input_ids=np.zeros((2, 2), dtype=np.int32))
    good = _req()
    good.input_ids = np.zeros((2, 2), dtype=np.int32)  # bypass __post_init__
    with pytest.raises(WireError, match="1-D"):
        decode(encode(good))


def test_defaults() -> None:
    a = m.AbortReq()
    assert (a.group_prefixes, a.abort_all) == ([], False)
    r = _req()
    assert r.logprob == m.LogprobParams() and r.logprob.input_start(5, 16) is None and not r.return_hidden_states
    assert (r.logprob.return_logprob, r.logprob.logprob_start_len, r.logprob.top_logprobs_num) == (False, -1, 0)
    assert r.logprob.token_ids_logprob is None and r.priority is None and r.extra_key is None
    ready = m.ReadyMsg(role="detokenizer", pid=1)
    assert ready.max_total_tokens == ready.context_len == ready.vocab_size == 0


def test_input_start_follows_sglangs_scheduler() -> None:
    lp = m.LogprobParams(return_logprob=True)
    assert lp.input_start(5, 16) == 4  # -1: the last prompt token, reported as one None entry
    assert lp.input_start(5, 0) is None  # prefill-only: SGLang skips input logprobs entirely
    assert m.LogprobParams(return_logprob=True, logprob_start_len=0).input_start(5, 0) == 0
    assert m.LogprobParams(return_logprob=True, logprob_start_len=3).input_start(5, 16) == 3
    assert m.LogprobParams(logprob_start_len=3).input_start(5, 16) is None  # no return_logprob: none


def test_empty_optional_columns_are_not_on_the_wire() -> None:
    out = m.BatchTokenIDOutput(
        rids=["a"], finished_reasons=[None], new_token_ids=[np.array([1], dtype="<i4")],
        counters=[m.ReqCounters(completion_tokens=1, cached_tokens=0)], detokenize_params=[None],
    )
    buf = encode(out)
    assert b"logprobs" not in buf and b"hidden" not in buf
    assert decode(buf).output_logprobs == [] and decode(buf).hidden_states == []


def test_str_output_is_not_a_token_output() -> None:
    # dispatch by isinstance must not confuse the two batch outputs
    assert not issubclass(m.BatchStrOutput, m.BatchTokenIDOutput)
    assert "texts" in m.BatchStrOutput.__struct_fields__
    assert "texts" not in m.BatchTokenIDOutput.__struct_fields__


@pytest.mark.parametrize(
    "reason, expected",
    [
        (m.FinishReason(type="stop", matched=2), {"type": "stop", "matched": 2}),
        (m.FinishReason(type="stop", matched="\n"), {"type": "stop", "matched": "\n"}),
        (m.FinishReason(type="length", length=16), {"type": "length", "length": 16}),
        (
            m.FinishReason(type="abort", message="bad", status_code=400),
            {"type": "abort", "message": "bad", "status_code": 400, "err_type": None},
        ),
        (  # SGLang's JSON has no field of its own: the message starts with it
            m.FinishReason.bad_request("sampling_params.regex", "does not compile: x"),
            {"type": "abort", "message": "sampling_params.regex does not compile: x", "status_code": 400,
             "err_type": "BadRequest"},
        ),
    ],
)
def test_finish_reason_json(reason: m.FinishReason, expected: dict) -> None:
    assert reason.to_json() == expected


def test_finish_reason_matched_keeps_int_vs_str() -> None:
    cols = dict(
        rids=["a", "b"], new_token_ids=[np.zeros(0, "<i4")] * 2, counters=[m.ReqCounters(completion_tokens=0, cached_tokens=0)] * 2,
        detokenize_params=[None, None],
    )
    reasons = [m.FinishReason(type="stop", matched=7), m.FinishReason(type="stop", matched="7")]
    out = decode(encode(m.BatchTokenIDOutput(finished_reasons=reasons, **cols)))
    assert [r.matched for r in out.finished_reasons] == [7, "7"]

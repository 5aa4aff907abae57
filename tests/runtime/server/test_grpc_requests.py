"""gRPC requests -> /generate bodies, without a server: only set fields are forwarded (unset and
explicit false stay distinct), the guided oneof and the deprecated fields are exclusive, and
errors name the proto's fields."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from smg_grpc_proto import sglang_scheduler_pb2 as spb

from tandem.runtime.server.grpc_requests import native_service_request, scheduler_service_request
from tandem.runtime.server.proto import sglang_pb2 as pb
from tandem.runtime.frontend.limits import RequestLimits
from tandem.runtime.value_checks import ValidationError

LIMITS = RequestLimits(vocab_size=100, context_len=128, max_total_tokens=64)  # max_request_len 64: the KV pool's


def test_only_set_fields_are_forwarded():
    req = pb.GenerateRequest(input_ids=[1, 2])
    assert native_service_request(req, LIMITS, text=False).native == {"input_ids": [1, 2]}
    explicit = pb.GenerateRequest(input_ids=[1], stream=False, require_reasoning=False, priority=0,
                                  sampling_params=pb.SamplingParams(temperature=0.0, ignore_eos=False, seed=0))
    body = native_service_request(explicit, LIMITS, text=False).native
    assert body == {"input_ids": [1], "stream": False, "require_reasoning": False, "priority": 0,
                    "sampling_params": {"temperature": 0.0, "ignore_eos": False, "seed": 0}}
    text = pb.TextGenerateRequest(text="hi", rid="r", max_thinking_tokens=3, return_text_in_logprobs=True)
    assert native_service_request(text, LIMITS, text=True).native == {
        "text": "hi", "rid": "r", "return_text_in_logprobs": True, "sampling_params": {"max_thinking_tokens": 3}}


@pytest.mark.parametrize("guided, native", [
    (pb.GuidedDecoding(json_schema='{"type": "object"}'), {"json_schema": '{"type": "object"}'}),
    (pb.GuidedDecoding(regex="a+"), {"regex": "a+"}),
    (pb.GuidedDecoding(ebnf='root ::= "x"'), {"ebnf": 'root ::= "x"'}),
    (pb.GuidedDecoding(choice=pb.ChoiceConstraint(values=["a.b", "c|d"])), {"choice": ["a.b", "c|d"]}),
    (pb.GuidedDecoding(structural_tag="{}"), {"structural_tag": "{}"}),
])
def test_each_guided_kind(guided, native):
    req = pb.GenerateRequest(input_ids=[1], sampling_params=pb.SamplingParams(guided_decoding=guided))
    assert native_service_request(req, LIMITS, text=False).native["sampling_params"] == native


@pytest.mark.parametrize("sp, field", [
    (pb.SamplingParams(regex="a", json_schema="{}"), "sampling_params.regex"),
    (pb.SamplingParams(regex="a", guided_decoding=pb.GuidedDecoding(ebnf="x")), "sampling_params.guided_decoding.ebnf"),
    (pb.SamplingParams(guided_decoding=pb.GuidedDecoding()), "sampling_params.guided_decoding"),
])
def test_constraint_conflicts_name_the_field(sp, field):
    with pytest.raises(ValidationError) as err:
        native_service_request(pb.GenerateRequest(input_ids=[1], sampling_params=sp), LIMITS, text=False)
    assert err.value.field == field


def test_native_errors_are_renamed_to_the_proto_fields():
    sp = pb.SamplingParams(guided_decoding=pb.GuidedDecoding(choice=pb.ChoiceConstraint()))
    req = native_service_request(pb.GenerateRequest(input_ids=[1], max_thinking_tokens=2, sampling_params=sp), LIMITS, text=False)
    assert req.rename(ValidationError("sampling_params.regex", "x")).field == "sampling_params.guided_decoding.choice"
    assert req.rename(ValidationError("sampling_params.max_thinking_tokens", "x")).field == "max_thinking_tokens"
    smg = scheduler_service_request(spb.GenerateRequest(sampling_params=spb.SamplingParams(ebnf_grammar="")), LIMITS)
    assert smg.rename(ValidationError("sampling_params.ebnf", "x")).field == "sampling_params.ebnf_grammar"


def test_scheduler_request_leaves_out_proto_zeros_that_mean_unset():
    req = spb.GenerateRequest(request_id="g1", tokenized=spb.TokenizedInput(input_ids=[4, 5]), stream=True,
                              sampling_params=spb.SamplingParams(temperature=0.7, max_new_tokens=0, regex="[0-9]"))
    body = scheduler_service_request(req, LIMITS).native
    assert body["rid"] == "g1" and body["input_ids"] == [4, 5] and body["stream"] is True
    sp = body["sampling_params"]
    assert sp["temperature"] == pytest.approx(0.7) and sp["max_new_tokens"] == 0 and sp["regex"] == "[0-9]"
    assert not {"top_p", "top_k", "n", "repetition_penalty", "stream_interval"} & set(sp)
    assert "return_logprob" not in body and "require_reasoning" not in body
    logprobs = scheduler_service_request(spb.GenerateRequest(return_logprob=True, top_logprobs_num=2,
                                                             logprob_start_len=-1, require_reasoning=True), LIMITS).native
    assert (logprobs["top_logprobs_num"], logprobs["logprob_start_len"], logprobs["require_reasoning"]) == (2, -1, True)
    # unset max_new_tokens fills the context (null), as SGLang's servicer passes None
    assert logprobs["sampling_params"]["max_new_tokens"] is None


def test_scheduler_request_shortens_max_new_tokens_to_the_context_as_sglangs_scheduler():
    """The gateway's requests reach SGLang's scheduler without the HTTP check, and it shortens an
    explicit max_new_tokens to the room the context leaves (the request then ends with "length")."""
    def max_new(asked: int, prompt_len: int, min_new: int = 0) -> tuple[int, int]:
        req = spb.GenerateRequest(tokenized=spb.TokenizedInput(input_ids=[3] * prompt_len),
                                  sampling_params=spb.SamplingParams(max_new_tokens=asked, min_new_tokens=min_new))
        sp = scheduler_service_request(req, LIMITS).native["sampling_params"]
        return sp["max_new_tokens"], sp.get("min_new_tokens", 0)

    assert [max_new(100000, 11)[0], max_new(20, 11)[0], max_new(53, 11)[0], max_new(5, 64)[0]] == [53, 20, 53, 0]
    assert max_new(100, 60, min_new=10) == (4, 4)  # min_new_tokens goes down with it, as the request ends there


@pytest.mark.parametrize("asked, prompt_len", [(5, 11), (100, 60)])
def test_scheduler_request_refuses_min_new_tokens_above_its_own_max_new_tokens(asked, prompt_len):
    """Refused as /generate refuses it, not shortened to max_new_tokens (a silently changed request),
    whether or not the context also shortens max_new_tokens."""
    req = spb.GenerateRequest(tokenized=spb.TokenizedInput(input_ids=[3] * prompt_len),
                              sampling_params=spb.SamplingParams(max_new_tokens=asked, min_new_tokens=asked + 1))
    with pytest.raises(ValidationError) as err:
        scheduler_service_request(req, LIMITS)
    assert err.value.field == "sampling_params.min_new_tokens" and f"({asked})" in err.value.message


class _HugeIds:
    def __len__(self) -> int:
        return 10**8

    def __iter__(self):
        raise AssertionError("the ids were listed")


class _HugeRequest:
    """An empty GenerateRequest but for tokenized.input_ids, which claims 10**8 ids."""

    tokenized = SimpleNamespace(input_ids=_HugeIds())

    def __getattr__(self, name: str) -> Any:
        return getattr(spb.GenerateRequest(), name)


def test_scheduler_request_refuses_an_overlong_prompt_before_listing_its_ids():
    """By its length: listing a message of 60M ids took a second of the event loop, every stream's."""
    with pytest.raises(ValidationError) as err:
        scheduler_service_request(_HugeRequest(), LIMITS)
    assert str(err.value) == "tokenized.input_ids has 100000000 tokens; a prompt must be shorter than the context length (128)"
    long = spb.GenerateRequest(tokenized=spb.TokenizedInput(input_ids=[1] * 200))
    cut = scheduler_service_request(long, dataclasses.replace(LIMITS, allow_auto_truncate=True))
    assert len(cut.native["input_ids"]) == 200  # --allow-auto-truncate: validation cuts it to its head


def test_native_request_refuses_overlong_ids_before_listing_them():
    request = SimpleNamespace(input_ids=_HugeIds())
    with pytest.raises(ValidationError, match="^input_ids has 100000000 tokens; a prompt must be shorter"):
        native_service_request(request, LIMITS, text=False)


def test_prompt_errors_name_the_protos_prompt_field():
    """The gateway's proto carries the ids in tokenized.input_ids, TextGenerate's in text."""
    smg = scheduler_service_request(spb.GenerateRequest(), LIMITS)
    assert str(smg.rename(ValidationError("input_ids", "must not be empty"))) == "tokenized.input_ids must not be empty"
    assert smg.rename(ValidationError("input_ids[3]", "x")).field == "tokenized.input_ids[3]"
    assert smg.rename(ValidationError("token_ids_logprob[0]", "x")).field == "token_ids_logprob[0]"
    text = native_service_request(pb.TextGenerateRequest(text="hi"), LIMITS, text=True)
    assert text.rename(ValidationError("input_ids", "x")).field == "text"
    ids = native_service_request(pb.GenerateRequest(input_ids=[1]), LIMITS, text=False)
    assert ids.rename(ValidationError("input_ids[0]", "x")).field == "input_ids[0]"


@pytest.mark.parametrize("req, field", [
    (spb.GenerateRequest(lora_id="x"), "lora_id"),
    (spb.GenerateRequest(mm_inputs=spb.MultimodalInputs(image_urls=["u"])), "mm_inputs"),
    (spb.GenerateRequest(input_embeds=[0.5]), "input_embeds"),
    # prefill/decode disaggregation and data-parallel ranks would be a different answer, not this one
    (spb.GenerateRequest(disaggregated_params=spb.DisaggregatedParams(bootstrap_host="h", bootstrap_room=3)),
     "disaggregated_params"),
    (spb.GenerateRequest(data_parallel_rank=3), "data_parallel_rank"),
])
def test_scheduler_request_refuses_what_the_server_lacks(req, field):
    with pytest.raises(ValidationError) as err:
        scheduler_service_request(req, LIMITS)
    assert err.value.field == field
    assert scheduler_service_request(spb.GenerateRequest(data_parallel_rank=0), LIMITS).native  # rank 0 is this one


@pytest.mark.parametrize("kw, field", [
    ({"disaggregated_params": pb.DisaggregatedParams(bootstrap_host="h", bootstrap_room=3)}, "disaggregated_params"),
    ({"routed_dp_rank": 3}, "routed_dp_rank"),
    ({"session_id": "s1"}, "session_id"),
    ({"lora_path": "adapter"}, "lora_path"),
])
def test_native_request_refuses_what_the_gateway_service_refuses(kw, field):
    with pytest.raises(ValidationError) as err:
        native_service_request(pb.TextGenerateRequest(text="x", **kw), LIMITS, text=True)
    assert err.value.field == field
    assert native_service_request(pb.TextGenerateRequest(text="x", routed_dp_rank=0), LIMITS, text=True).native


# SGLang's field numbers and types on main (proto/sglang/runtime/v1/sglang.proto; its Rust
# request_utils.rs reads these fields): an SGLang client's bytes must mean the same here
SGLANG_NUMBERS = {
    "TextGenerateRequest": {"session_id": (13, "string"), "disaggregated_params": (14, "message"),
                            "priority": (15, "int32"), "require_reasoning": (16, "bool"),
                            "max_thinking_tokens": (17, "uint32")},
    "GenerateRequest": {"session_id": (12, "string"), "disaggregated_params": (13, "message"),
                        "priority": (14, "int32"), "require_reasoning": (15, "bool"),
                        "max_thinking_tokens": (16, "uint32")},
    "ChoiceConstraint": {"values": (1, "string")},
}
_TYPE_NAMES = {9: "string", 11: "message", 5: "int32", 8: "bool", 13: "uint32"}


@pytest.mark.parametrize("message", sorted(SGLANG_NUMBERS))
def test_the_proto_has_sglangs_field_numbers_and_types(message):
    fields = getattr(pb, message).DESCRIPTOR.fields_by_name
    got = {name: (fields[name].number, _TYPE_NAMES[fields[name].type]) for name in SGLANG_NUMBERS[message]}
    assert got == SGLANG_NUMBERS[message]


def test_an_sglang_clients_priority_bytes_arrive_as_priority():
    """Hand-encoded as SGLang's client writes GenerateRequest: input_ids [7] (field 1, packed),
    priority 3 (field 14, varint), max_thinking_tokens 5 (field 16, varint)."""
    key_16 = (16 << 3) | 0  # 128: a two-byte varint
    wire = bytes([(1 << 3) | 2, 1, 7, (14 << 3) | 0, 3, key_16 & 0x7F | 0x80, key_16 >> 7, 5])
    body = native_service_request(pb.GenerateRequest.FromString(wire), LIMITS, text=False).native
    assert body == {"input_ids": [7], "priority": 3, "sampling_params": {"max_thinking_tokens": 5}}

"""SGLang's native gRPC service against a running tandem: a client built from tandem's proto,
and one whose stubs are generated here from the seed's field numbers (wire compatibility by
number): seeds, priority, every guided kind, the reasoning controls, unset vs explicit false,
errors as INVALID_ARGUMENT naming the field, and the service's other RPCs."""
from __future__ import annotations

import importlib.util
import json
import sys

import grpc
import pytest
from grpc_tools import protoc

from server_utils import assert_no_leaks
from tandem.runtime.server.proto import sglang_pb2 as pb

pytestmark = pytest.mark.timeout(600)
SERVICE = "/sglang.runtime.v1.SglangService/"

# SGLang's numbers and types (SamplingParams.seed = 16, guided_decoding = 17, ChoiceConstraint.values,
# GenerateRequest's session_id 12 ... max_thinking_tokens 16 as uint32), written out here in a package
# of its own, so an SGLang client's bytes are what reach the server: only numbers go on the wire.
SEED_PROTO = """
syntax = "proto3";
package seedcheck.v1;
message ChoiceConstraint { repeated string values = 1; }
message GuidedDecoding { oneof constraint { string json_schema = 1; string regex = 2; string ebnf = 3;
                                            ChoiceConstraint choice = 4; string structural_tag = 5; } }
message SamplingParams { optional float temperature = 1; optional int32 max_new_tokens = 8; optional int32 n = 13;
                         optional int64 seed = 16; optional GuidedDecoding guided_decoding = 17; }
message GenerateRequest { repeated int32 input_ids = 1; optional SamplingParams sampling_params = 2;
                          optional bool stream = 3; optional string session_id = 12; optional int32 priority = 14;
                          optional bool require_reasoning = 15; optional uint32 max_thinking_tokens = 16; }
message GenerateResponse { repeated int32 output_ids = 1; map<string, string> meta_info = 2; bool finished = 3; }
"""


@pytest.fixture(scope="module")
def channel(grpc_server):
    with grpc.insecure_channel(grpc_server.grpc_target) as ch:
        yield ch


def _call(channel, method: str, request, response_cls, stream: bool = True):
    make = channel.unary_stream if stream else channel.unary_unary
    rpc = make(SERVICE + method, request_serializer=type(request).SerializeToString,
               response_deserializer=response_cls.FromString)
    return list(rpc(request, timeout=120)) if stream else rpc(request, timeout=60)


def generate(channel, **kw) -> list:
    return _call(channel, "Generate", pb.GenerateRequest(**kw), pb.GenerateResponse)


@pytest.fixture(scope="module")
def seed_pb(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed_proto")
    (out / "seedcheck.proto").write_text(SEED_PROTO)
    assert protoc.main(["protoc", f"-I{out}", f"--python_out={out}", str(out / "seedcheck.proto")]) == 0
    spec = importlib.util.spec_from_file_location("seedcheck_pb2", out / "seedcheck_pb2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["seedcheck_pb2"] = module
    spec.loader.exec_module(module)
    return module


def test_greedy_generate_equals_http_and_text_generate(channel, grpc_server):
    sp = pb.SamplingParams(temperature=0, max_new_tokens=8)
    (out,) = generate(channel, input_ids=[5, 6, 7, 8], sampling_params=sp)
    http = grpc_server.generate({"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert list(out.output_ids) == http["output_ids"] and out.finished
    assert json.loads(out.meta_info["finish_reason"]) == http["meta_info"]["finish_reason"]
    (text,) = _call(channel, "TextGenerate", pb.TextGenerateRequest(text="Hello there", sampling_params=sp),
                    pb.TextGenerateResponse)
    assert text.text == grpc_server.generate({"text": "Hello there", "sampling_params": {
        "temperature": 0, "max_new_tokens": 8}})["text"]
    # long enough that a loaded machine's slow reader cannot see every step coalesce into the last
    # chunk (8 tokens once arrived as one message on CI); the first 8 are the ones above
    long_sp = pb.SamplingParams(temperature=0, max_new_tokens=96, ignore_eos=True)
    streamed = generate(channel, input_ids=[5, 6, 7, 8], sampling_params=long_sp, stream=True)
    assert len(streamed) > 1 and streamed[-1].finished and len(streamed[-1].output_ids) == 96
    assert list(streamed[-1].output_ids)[:8] == http["output_ids"]
    assert all(list(a.output_ids) == list(b.output_ids)[:len(a.output_ids)] for a, b in zip(streamed, streamed[1:]))


def test_n_choices_end_with_one_finished_message_as_sglangs(channel):
    """SGLang's #32588: with n > 1 `finished` is set on one message only, the call's last, once
    every choice is done (streamed), or on the last choice's message (not streamed): a client
    that stops at the first `finished` has every choice."""
    sp = pb.SamplingParams(temperature=0.8, max_new_tokens=12, n=2, seed=7, ignore_eos=True)
    whole = generate(channel, input_ids=[5, 6, 7], sampling_params=sp)
    assert len(whole) == 2 and [m.finished for m in whole] == [False, True]
    streamed = generate(channel, input_ids=[5, 6, 7], sampling_params=sp, stream=True)
    assert [m.finished for m in streamed].count(True) == 1 and streamed[-1].finished
    finals = {}
    for m in streamed:
        finals[json.loads(m.meta_info.get("index", "0"))] = list(m.output_ids)
    assert sorted(len(ids) for ids in finals.values()) == [12, 12]


def test_seed_fields_by_number(channel, seed_pb):
    """A client that knows only the seed's numbers: seeds reproduce, choices (regex
    metacharacters included) constrain, n > 1 answers per index, priority is accepted."""
    rpc = channel.unary_stream(SERVICE + "Generate", request_serializer=seed_pb.GenerateRequest.SerializeToString,
                               response_deserializer=seed_pb.GenerateResponse.FromString)

    def run(**kw) -> list:
        return list(rpc(seed_pb.GenerateRequest(input_ids=[5, 6, 7], **kw), timeout=120))

    seeded = seed_pb.SamplingParams(temperature=1.0, max_new_tokens=8, seed=42)
    first, again = run(sampling_params=seeded), run(sampling_params=seeded, priority=5)
    assert list(first[0].output_ids) == list(again[0].output_ids)
    other = run(sampling_params=seed_pb.SamplingParams(temperature=1.0, max_new_tokens=8, seed=43))
    assert list(other[0].output_ids) != list(first[0].output_ids)
    choices = ["a.b", "c|d", "(x)"]
    guided = seed_pb.GuidedDecoding(choice=seed_pb.ChoiceConstraint(values=choices))
    outs = run(sampling_params=seed_pb.SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=1,
                                                      guided_decoding=guided))
    assert sorted(int(o.meta_info["index"]) for o in outs) == [0, 1, 2]
    texts = [_decode(o.output_ids) for o in outs]
    assert all(t in choices for t in texts), texts


def _decode(ids) -> str:
    from transformers import AutoTokenizer

    tok = _decode.__dict__.setdefault("tok", AutoTokenizer.from_pretrained(_decode.model_dir))
    return tok.decode(list(ids), skip_special_tokens=True)


@pytest.fixture(autouse=True, scope="module")
def _tokenizer_dir(tiny_model_dir):
    _decode.model_dir = tiny_model_dir("llama")


@pytest.mark.parametrize("guided, check", [
    (pb.GuidedDecoding(json_schema=json.dumps({"type": "object", "properties": {"k": {"enum": ["v", "w"]}},
                                                "required": ["k"], "additionalProperties": False})),
     lambda t: json.loads(t)["k"] in ("v", "w")),
    (pb.GuidedDecoding(regex="[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
    (pb.GuidedDecoding(ebnf='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
])
def test_each_guided_kind(channel, guided, check):
    (out,) = generate(channel, input_ids=[5, 6, 7], sampling_params=pb.SamplingParams(
        temperature=0, max_new_tokens=40, guided_decoding=guided))
    text = _decode(out.output_ids)
    assert check(text), text


def test_reasoning_controls_and_unset_vs_false(channel):
    """require_reasoning + a budget: free reasoning, the forced </think>, then the grammar;
    explicit false behaves as unset (the grammar from the first token)."""
    sp = pb.SamplingParams(temperature=0, max_new_tokens=40, guided_decoding=pb.GuidedDecoding(regex="[0-9]{2}"))
    (out,) = generate(channel, input_ids=[5, 6, 7], sampling_params=sp, require_reasoning=True, max_thinking_tokens=3)
    text = _decode(out.output_ids)
    assert "</think>" in text and text.split("</think>")[1].isdigit(), text
    (plain,) = generate(channel, input_ids=[5, 6, 7], sampling_params=sp, require_reasoning=False)
    (unset,) = generate(channel, input_ids=[5, 6, 7], sampling_params=sp)
    assert _decode(plain.output_ids).isdigit() and list(plain.output_ids) == list(unset.output_ids)


@pytest.mark.parametrize("kw, field", [
    ({"sampling_params": pb.SamplingParams(regex="a", json_schema="{}")}, "sampling_params.regex"),
    ({"sampling_params": pb.SamplingParams(guided_decoding=pb.GuidedDecoding(regex=""))},
     "sampling_params.guided_decoding.regex"),
    ({"sampling_params": pb.SamplingParams(guided_decoding=pb.GuidedDecoding(json_schema="{nope"))},
     "sampling_params.guided_decoding.json_schema"),
    ({"sampling_params": pb.SamplingParams(guided_decoding=pb.GuidedDecoding(regex="(unclosed"))},
     "sampling_params.guided_decoding.regex"),  # found by the scheduler, when the grammar compiles
    ({"sampling_params": pb.SamplingParams(temperature=-1)}, "sampling_params.temperature"),
    ({"max_thinking_tokens": 2, "sampling_params": pb.SamplingParams(regex="a+")}, "max_thinking_tokens"),
])
def test_bad_fields_are_invalid_argument_naming_the_field(channel, grpc_server, kw, field):
    with pytest.raises(grpc.RpcError) as err:
        generate(channel, input_ids=[5, 6], **kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field), \
        err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        generate(channel, input_ids=[10 ** 6])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids" in err.value.details()
    assert_no_leaks(grpc_server)


def test_other_rpcs(channel, grpc_server):
    assert _call(channel, "HealthCheck", pb.HealthCheckRequest(), pb.HealthCheckResponse, stream=False).healthy
    info = _call(channel, "GetModelInfo", pb.GetModelInfoRequest(), pb.GetModelInfoResponse, stream=False)
    assert json.loads(info.json_info)["vocab_size"] == 49152
    server = json.loads(_call(channel, "GetServerInfo", pb.GetServerInfoRequest(), pb.GetServerInfoResponse,
                              stream=False).json_info)
    assert server["max_total_num_tokens"] > 0 and "api_key" not in server
    models = _call(channel, "ListModels", pb.ListModelsRequest(), pb.ListModelsResponse, stream=False)
    assert models.models[0].max_model_len == 2048
    load = json.loads(_call(channel, "GetLoad", pb.GetLoadRequest(), pb.GetLoadResponse, stream=False).json_info)
    assert load["loads"][0]["num_running_reqs"] == 0 and load["dp_rank_count"] == 1
    tok = _call(channel, "Tokenize", pb.TokenizeRequest(text="Hello world"), pb.TokenizeResponse, stream=False)
    assert tok.count == len(tok.tokens) > 0
    text = _call(channel, "Detokenize", pb.DetokenizeRequest(tokens=tok.tokens), pb.DetokenizeResponse, stream=False)
    assert text.text == "Hello world"
    framed = pb.DetokenizeRequest(tokens=[1, *tok.tokens, 2, 0])  # <|im_start|> ... <|im_end|><|endoftext|>
    text = _call(channel, "Detokenize", framed, pb.DetokenizeResponse, stream=False)
    assert text.text == "Hello world"  # special tokens skipped, as SGLang's Detokenize
    with pytest.raises(grpc.RpcError) as err:
        _call(channel, "Detokenize", pb.DetokenizeRequest(tokens=[-1]), pb.DetokenizeResponse, stream=False)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("tokens[0]")
    flushed = _call(channel, "FlushCache", pb.FlushCacheRequest(), pb.FlushCacheResponse, stream=False)
    assert flushed.success
    assert not _call(channel, "Abort", pb.AbortRequest(rid="nobody"), pb.AbortResponse, stream=False).success
    with pytest.raises(grpc.RpcError) as err:
        _call(channel, "TextEmbed", pb.TextEmbedRequest(text="x"), pb.TextEmbedResponse, stream=False)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "not implemented" in err.value.details()


def test_abort_and_client_cancel_end_exactly_that_request(channel, grpc_server):
    long = pb.SamplingParams(temperature=0, max_new_tokens=1500, ignore_eos=True)
    rpc = channel.unary_stream(SERVICE + "Generate", request_serializer=pb.GenerateRequest.SerializeToString,
                               response_deserializer=pb.GenerateResponse.FromString)
    call = rpc(pb.GenerateRequest(input_ids=[5, 6], sampling_params=long, stream=True, rid="g-abort"), timeout=120)
    next(call)  # running
    assert _call(channel, "Abort", pb.AbortRequest(rid="g-abort"), pb.AbortResponse, stream=False).success
    last = list(call)[-1]
    assert json.loads(last.meta_info["finish_reason"])["type"] == "abort"
    cancelled = rpc(pb.GenerateRequest(input_ids=[5, 6], sampling_params=long, stream=True), timeout=120)
    next(cancelled)
    cancelled.cancel()
    assert_no_leaks(grpc_server)  # the server noticed the cancel and aborted the request

"""The gateway's gRPC service (sglang.grpc.scheduler.SglangScheduler) through the smg-grpc-proto
stubs against a running tandem: every RPC, streaming and not, n = 2, logprobs, each guided kind,
each INVALID_ARGUMENT case, a client cancel that aborts, and greedy output equal to /generate."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto import sglang_scheduler_pb2 as pb
from smg_grpc_proto import sglang_scheduler_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from server_utils import assert_no_leaks

pytestmark = pytest.mark.timeout(600)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def stub(grpc_server):
    with grpc.insecure_channel(grpc_server.grpc_target) as ch:
        yield pb_grpc.SglangSchedulerStub(ch)


def params(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**{"temperature": 0.0, "max_new_tokens": 8, **kw})


def generate(stub, rid: str = "", stream: bool = False, **kw) -> list:
    sp = kw.pop("sampling_params", params())
    return list(stub.Generate(pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                                 sampling_params=sp, stream=stream, **kw), timeout=120))


def test_greedy_equals_generate_streamed_and_not(stub, grpc_server):
    http = grpc_server.generate({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                                 "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    (whole,) = generate(stub, "s1", return_logprob=True, top_logprobs_num=2, logprob_start_len=-1)
    done = whole.complete
    assert whole.request_id == "s1" and list(done.output_ids) == http["output_ids"]
    assert done.finish_reason == "length" and done.completion_tokens == 8 and done.prompt_tokens == 4
    assert list(done.output_logprobs.token_logprobs) == pytest.approx(
        [r[0] for r in http["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert all(len(t.token_ids) == 2 for t in done.output_logprobs.top_logprobs)
    streamed = generate(stub, "s2", stream=True, return_logprob=True, top_logprobs_num=2, logprob_start_len=-1)
    chunks = [r.chunk for r in streamed if r.HasField("chunk")]
    assert streamed[-1].HasField("complete") and [r.HasField("complete") for r in streamed].count(True) == 1
    assert [t for c in chunks for t in c.token_ids] == http["output_ids"]
    assert list(streamed[-1].complete.output_ids) == list(chunks[-1].token_ids)  # the last delta, as SGLang
    assert [v for c in chunks for v in c.output_logprobs.token_logprobs] == pytest.approx(
        list(done.output_logprobs.token_logprobs), abs=1e-5)
    prompt_lp = generate(stub, return_logprob=True, logprob_start_len=0)[0].complete.input_logprobs
    assert not prompt_lp.token_logprobs[0].HasField("value") and len(prompt_lp.token_ids) == len(PROMPT)
    # as SGLang's servicer: no prompt logprobs for start -1, and a stream sends them once (first chunk)
    assert not done.HasField("input_logprobs") and not any(c.HasField("input_logprobs") for c in chunks)
    scored = generate(stub, stream=True, return_logprob=True, logprob_start_len=0)
    assert [r.chunk.HasField("input_logprobs") if r.HasField("chunk") else r.complete.HasField("input_logprobs")
            for r in scored] == [True] + [False] * (len(scored) - 1)


def test_token_ids_logprobs_hidden_states_and_a_long_max_new_tokens(stub, grpc_server):
    """token_ids_logprob rows per output token, return_hidden_states rows per position, and a
    max_new_tokens past the context shortened to what fits (SGLang's scheduler) instead of refused."""
    http = grpc_server.generate({"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [5, 9],
                                 "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    (out,) = generate(stub, return_logprob=True, token_ids_logprob=[5, 9], return_hidden_states=True,
                      logprob_start_len=-1)
    rows = out.complete.output_logprobs.token_ids_logprobs
    assert [list(r.token_ids) for r in rows] == [[5, 9]] * 8
    assert [v for r in rows for v in r.values] == pytest.approx(
        [v[0] for row in http["meta_info"]["output_token_ids_logprobs"] for v in row], abs=1e-5)
    hidden = out.complete.all_hidden_states
    assert [h.position for h in hidden] == list(range(len(PROMPT) - 1, len(PROMPT) + 7))
    assert len({len(h.values) for h in hidden}) == 1 and len(hidden[0].values) > 0
    (long,) = stub.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[5] * 2040),
                                               sampling_params=params(max_new_tokens=100000, ignore_eos=True)),
                            timeout=120)
    assert long.complete.finish_reason == "length" and long.complete.completion_tokens == 8  # 2048 - 2040


def test_n2_answers_per_index(stub):
    sp = params(temperature=1.0, n=2, max_new_tokens=6, ignore_eos=True)
    out = generate(stub, "n2", stream=True, sampling_params=sp)
    completes = [r.complete for r in out if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1]
    whole = {r.complete.index: list(r.complete.output_ids) for r in generate(stub, sampling_params=sp)}
    assert sorted(whole) == [0, 1] and all(len(ids) == 6 for ids in whole.values())
    for c in completes:
        streamed = [t for r in out if r.HasField("chunk") and r.chunk.index == c.index for t in r.chunk.token_ids]
        assert len(streamed) == 6 and streamed[-len(c.output_ids):] == list(c.output_ids)


@pytest.mark.parametrize("constraint, check", [
    ({"regex": "[0-9]{4}"}, lambda t: len(t) == 4 and t.isdigit()),
    ({"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                                 "additionalProperties": False})}, lambda t: isinstance(json.loads(t)["a"], bool)),
    ({"ebnf_grammar": 'root ::= "red" | "blue"'}, lambda t: t in ("red", "blue")),
    ({"structural_tag": json.dumps({"type": "structural_tag", "triggers": ["<x>"], "structures": [
        {"begin": "<x>", "schema": {"type": "integer"}, "end": "</x>"}]})}, lambda t: True),
])
def test_each_guided_kind(stub, smol_tokenizer, constraint, check):
    (out,) = generate(stub, sampling_params=params(max_new_tokens=40, **constraint))
    text = smol_tokenizer.decode(list(out.complete.output_ids), skip_special_tokens=True)
    assert check(text), text


@pytest.mark.parametrize("kw, field", [
    ({"sampling_params": params(regex="")}, "sampling_params.regex"),
    ({"sampling_params": params(json_schema="{bad")}, "sampling_params.json_schema"),
    ({"sampling_params": params(ebnf_grammar='root ::= "a" |')}, "sampling_params.ebnf_grammar"),  # the scheduler's
    ({"sampling_params": params(temperature=-2.0)}, "sampling_params.temperature"),
    ({"sampling_params": params(min_new_tokens=9)}, "sampling_params.min_new_tokens"),  # above max_new_tokens (8)
    ({"sampling_params": params(logit_bias={"99999999": 1.0})}, "sampling_params.logit_bias"),
    ({"lora_id": "adapter"}, "lora_id"),
])
def test_invalid_argument_names_the_field(stub, kw, field):
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, **kw)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field), \
        err.value.details()


def test_out_of_range_ids_and_two_constraints_are_refused(stub, grpc_server):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[49152]),
                                              sampling_params=params()), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids" in err.value.details()
    # a proto oneof cannot carry two constraints: the last one set wins on the client
    sp = params(regex="a")
    sp.json_schema = "{}"
    assert sp.WhichOneof("constraint") == "json_schema"
    assert_no_leaks(grpc_server)


def _aborted(server) -> float:
    return sum(sample.value for family in text_string_to_metric_families(server.get("/metrics").text)
               for sample in family.samples if sample.name == "sglang:num_aborted_requests_total")


def test_abort_and_cancel(stub, grpc_server):
    """Abort by id, and a client cancel mid-stream: both end on the scheduler as aborts (not by
    running to max_new_tokens), and nothing leaks."""
    aborted = _aborted(grpc_server)
    long = params(max_new_tokens=1500, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(request_id="gw-1", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                            sampling_params=long, stream=True), timeout=120)
    next(call)
    reply = stub.Abort(pb.AbortRequest(request_id="gw-1"), timeout=30)
    assert reply.success
    assert [r.complete.finish_reason for r in call if r.HasField("complete")] == ["abort"]
    assert not stub.Abort(pb.AbortRequest(request_id="gw-1"), timeout=30).success
    cancelled = stub.Generate(pb.GenerateRequest(request_id="gw-2", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                                                 sampling_params=long, stream=True), timeout=120)
    next(cancelled)
    cancelled.cancel()
    assert_no_leaks(grpc_server)
    assert _aborted(grpc_server) == aborted + 2


def test_info_loads_flush_tokenizer_and_unimplemented(stub, grpc_server, smol_tokenizer):
    health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=60)
    assert health.healthy
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.vocab_size == 49152 and info.max_context_length == 2048 and info.is_generation
    assert list(info.eos_token_ids) == [smol_tokenizer.eos_token_id]  # the ids the scheduler stops on
    assert (list(info.architectures), info.model_type, info.weight_version) == (["LlamaForCausalLM"], "llama", "default")
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    assert server.server_type == "grpc" and server.max_total_num_tokens == 6000
    loads = stub.GetLoads(pb.GetLoadsRequest(include=["core", "queues"]), timeout=30)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens == 6000
    assert not stub.GetLoads(pb.GetLoadsRequest(dp_rank=3), timeout=30).loads  # no such rank here
    with pytest.raises(grpc.RpcError) as err:
        stub.GetLoads(pb.GetLoadsRequest(include=["bogus"]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "include" in err.value.details()
    args = server.server_args
    assert args["model_path"] and args["weight_version"] == "default" and args["dp_size"] == 1
    assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5), timeout=30).success
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert "tokenizer.json" in zipfile.ZipFile(io.BytesIO(data)).namelist()
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # a streaming one too: the gateway's KV-event subscription stops only on UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as err:
        list(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value.details()


def test_require_reasoning_reports_reasoning_tokens(stub, grpc_server):
    """require_reasoning asks the scheduler to count reasoning tokens: the count comes back in each
    chunk (cumulative) and in the complete, as /generate's meta_info.reasoning_tokens."""
    http = grpc_server.generate({"input_ids": PROMPT, "require_reasoning": True,
                                 "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    counted = http["meta_info"]["reasoning_tokens"]
    assert counted > 0
    streamed = generate(stub, stream=True, require_reasoning=True)
    chunks = [r.chunk for r in streamed if r.HasField("chunk")]
    assert chunks[-1].reasoning_tokens == counted and streamed[-1].complete.reasoning_tokens == counted
    assert [c.reasoning_tokens for c in chunks] == sorted(c.reasoning_tokens for c in chunks)
    (whole,) = generate(stub, require_reasoning=True)
    assert whole.complete.reasoning_tokens == counted
    assert generate(stub)[0].complete.reasoning_tokens == 0

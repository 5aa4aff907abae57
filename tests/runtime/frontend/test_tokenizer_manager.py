"""The main (HTTP / tokenizer-manager) process never imports torch or model code."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import asyncio, json, sys
from tandem.runtime.server.http import create_app
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager

async def main():
    tm = TokenizerManager(ServerArgs(model_path=sys.argv[1], max_total_tokens=2000, max_running_requests=4))
    try:
        await tm.start()
        out = await tm.generate({"input_ids": [5, 6, 7], "return_logprob": True, "return_hidden_states": True,
                                 "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    finally:
        tm.close()
    heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "tandem.runtime.model.",
                                                                          "tandem.runtime.scheduler.", "triton")))
    print(json.dumps({"tokens": len(out["output_ids"]), "heavy": heavy}))

asyncio.run(main())
"""


def test_a_fresh_tokenizer_manager_process_has_no_torch(tiny_model_dir, tmp_path):
    # cwd away from the repo root: its kernels/ folder would shadow the PyPI `kernels`
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_dir("llama")], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"tokens": 3, "heavy": []}


GRPC_SCRIPT = """
import asyncio, json, sys
import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as spb, sglang_scheduler_pb2_grpc as spb_grpc
from tandem.runtime.launcher import free_port
from tandem.runtime.server.grpc_common import GrpcAuth
from tandem.runtime.server.grpc_server import bind_grpc_server
from tandem.runtime.server.proto import sglang_pb2 as pb
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager

async def main():
    tm = TokenizerManager(ServerArgs(model_path=sys.argv[1], max_total_tokens=2000, max_running_requests=4))
    port = free_port()
    try:
        await tm.start()
        server = bind_grpc_server(tm, "127.0.0.1", port, GrpcAuth())
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            native = ch.unary_stream("/sglang.runtime.v1.SglangService/Generate",
                                     request_serializer=pb.GenerateRequest.SerializeToString,
                                     response_deserializer=pb.GenerateResponse.FromString)
            sp = pb.SamplingParams(temperature=0, max_new_tokens=3)
            first = [r async for r in native(pb.GenerateRequest(input_ids=[5, 6, 7], sampling_params=sp,
                                                                stream=True, return_logprob=True))]
            gateway = spb_grpc.SglangSchedulerStub(ch)
            second = [r async for r in gateway.Generate(spb.GenerateRequest(
                request_id="g", tokenized=spb.TokenizedInput(input_ids=[5, 6, 7]), stream=True,
                return_logprob=True, return_hidden_states=True,
                sampling_params=spb.SamplingParams(temperature=0, max_new_tokens=3)))]
        await server.stop(grace=None)
    finally:
        tm.close()
    tokens = [len(first[-1].output_ids), sum(len(r.chunk.token_ids) for r in second if r.HasField("chunk"))]
    heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "tandem.runtime.model.",
                                                                          "tandem.runtime.scheduler.", "triton")))
    print(json.dumps({"tokens": tokens, "heavy": heavy}))

asyncio.run(main())
"""


def test_the_grpc_front_has_no_torch(tiny_model_dir, tmp_path):
    """Both gRPC services, streaming with logprobs (and hidden states on the gateway's), in a
    process that imports no torch, triton, scheduler or model execution code. The one model
    module it reaches is model.config (GetModelInfo's architecture -> model_type table, torch-free)."""
    proc = subprocess.run([sys.executable, "-c", GRPC_SCRIPT, tiny_model_dir("llama")], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"tokens": [3, 3], "heavy": ["tandem.runtime.model.config"]}


def test_chat_sampling_defaults_follow_the_flag(tmp_path):
    from tandem.runtime.server_args import ServerArgs
    from tandem.runtime.frontend.tokenizer_manager import _chat_sampling_defaults

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 0.7}))
    assert _chat_sampling_defaults(ServerArgs(model_path=str(tmp_path))) == {"top_k": 1, "temperature": 0.7}
    assert _chat_sampling_defaults(ServerArgs(model_path=str(tmp_path), sampling_defaults="openai")) == {}


def test_a_chat_template_file_sets_the_content_format(tiny_model_dir, tmp_path):
    """--chat-template is read as SGLang reads it, and the format of message content (a list of
    parts or one string) follows the template in use."""
    from tandem.runtime.server_args import ServerArgs
    from tandem.runtime.frontend.tokenizer_manager import TokenizerManager

    looping = tmp_path / "parts.jinja"
    looping.write_text("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}!\\n{% endfor %}\n")
    for template, content_format in ((str(looping), "openai"), (None, "string")):
        tm = TokenizerManager(ServerArgs(model_path=tiny_model_dir("llama"), chat_template=template))
        try:
            assert tm.chat_content_format == content_format
            if template:
                assert tm.render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}]}], {}) == "a!\n"
        finally:
            tm.close()


UNSTARTED_STREAM = """
import asyncio, json, sys
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.frontend.tokenizer_manager import TokenizerManager

async def main():
    tm = TokenizerManager(ServerArgs(model_path=sys.argv[1], max_total_tokens=2000, max_running_requests=4))
    long = {"rid": "r", "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    try:
        await tm.start()
        stream = await tm.generate_stream({**long, "stream": True})
        await stream.aclose()  # never iterated: a client gone before its first chunk
        held = sorted(tm.groups)
        again = await tm.generate({**long, "sampling_params": {"max_new_tokens": 2}})  # the rid is free
        info = await tm.server_info()
    finally:
        tm.close()
    print(json.dumps({"held": held, "tokens": len(again["output_ids"]), "running": info["num_running_reqs"]}))

asyncio.run(main())
"""


def test_a_stream_closed_before_its_first_chunk_ends_its_request(tiny_model_dir, tmp_path):
    """An async generator that never started never runs its `finally`: closing the stream object
    must still abort the request (1500 tokens would still be running) and free its rid."""
    proc = subprocess.run([sys.executable, "-c", UNSTARTED_STREAM, tiny_model_dir("llama")], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"held": [], "tokens": 2, "running": 0}


def test_control_requests_fail_at_once_when_a_child_has_died(tiny_model_dir):
    """A control request waiting for the scheduler wakes with the death, and later ones are
    refused at once (an Engine outlives its children; before, each waited the 10 s timeout)."""
    import asyncio

    from tandem.runtime.frontend.request_groups import RequestError
    from tandem.runtime.server_args import ServerArgs
    from tandem.runtime.frontend.tokenizer_manager import TokenizerManager

    async def main() -> list[str]:
        tm = TokenizerManager(ServerArgs(model_path=tiny_model_dir("llama"), max_total_tokens=2000))  # no children
        try:
            waiting = asyncio.ensure_future(tm.server_info(timeout=60))
            await asyncio.sleep(0.05)
            tm.fail_all("tandem-scheduler process died (exit code -9)")
            errors = []
            for call in (lambda: waiting, lambda: tm.flush_cache()):
                with pytest.raises(RequestError) as err:
                    await asyncio.wait_for(call(), 5)
                errors.append(f"{err.value.status_code} {err.value.message}")
            return errors
        finally:
            tm.close()

    assert asyncio.run(main()) == ["500 tandem-scheduler process died (exit code -9)"] * 2

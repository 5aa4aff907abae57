"""Session-wide servers: started once, shared by the end-to-end tests, always stopped."""
from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest

from server_utils import start_server

TINY_ARGS = ["--max-total-tokens", "6000", "--max-running-requests", "64"]
NGRAM = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4"]
# "tiny" and "smol" serve most modules and stay up; the other configurations, each used by a module or
# two, share this many units (a tiny-model server ~0.8 GB: 1, a SmolLM2 one ~2.7 GB: 3). All 20 kept
# up at once took 23 of the machine's 24 GB, and CI's pytest was killed for memory.
PINNED = ("tiny", "smol")
SMOL_ARGS = ("--max-total-tokens", "20000", "--max-running-requests", "32", "--quantization", "none")
TOOLS_TEMPLATE = str(Path(__file__).parent / "templates" / "qwen25_tools.jinja")
UNITS_UP = 6


def _units(name: str) -> int:
    return 3 if name.startswith("smol") else 1


@pytest.fixture(scope="session")
def servers(tmp_path_factory, tiny_model_dir):
    """Start servers lazily by name; the least recently asked for of the unpinned ones is stopped when
    they would take more than UNITS_UP (and started again if asked for later); every one left is
    stopped at session end. A test asks by name each time it uses one, so it never holds a stopped one."""
    started: OrderedDict[str, object] = OrderedDict()
    leaks: list[str] = []
    failed: dict[str, RuntimeError] = {}
    logs = tmp_path_factory.mktemp("server_logs")

    def embedder() -> str:
        """The tiny Qwen3 in Qwen3-Embedding's layout: sentence-transformers' last-token pooling, normalized."""
        out = tmp_path_factory.getbasetemp() / "tiny_qwen3_embedding"
        if not out.exists():
            shutil.copytree(tiny_model_dir("qwen3"), out)
            (out / "1_Pooling").mkdir()
            (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
            (out / "modules.json").write_text(json.dumps([
                {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        return str(out)

    def standalone(model: str | None, layers: int) -> list[str]:
        from tandem.launch.make_tiny_model import build_truncated_model

        draft = build_truncated_model(model, tmp_path_factory.getbasetemp() / f"draft_{layers}_{bool(model)}", layers)
        return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft),
                "--speculative-num-draft-tokens", "4"]

    def stop(name: str) -> None:
        try:
            started.pop(name).stop()  # type: ignore[attr-defined]
        except AssertionError as exc:  # a leak: reported at session end, not on whoever evicted it
            leaks.append(str(exc))

    def evict_for(name: str) -> None:
        """Room for `name` within UNITS_UP; a pinned one needs none."""
        if name in PINNED:
            return
        unpinned = [n for n in started if n not in PINNED]
        while unpinned and sum(map(_units, unpinned)) + _units(name) > UNITS_UP:
            stop(unpinned.pop(0))

    def get(name: str):
        if name in started:
            started.move_to_end(name)
        else:
            tiny = tiny_model_dir("llama")
            configs = {
                "tiny": (["--model-path", tiny, *TINY_ARGS], None),
                "tiny_sequential_chunked_retract": (["--model-path", tiny, *TINY_ARGS, "--chunked-prefill-size", "16",
                                                     "--disable-overlap-schedule"],
                                                    {"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_overlap_chunked_retract": (["--model-path", tiny, *TINY_ARGS, "--chunked-prefill-size", "16"],
                                                 {"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_retract_8": (["--model-path", tiny, "--max-total-tokens", "12000", "--max-running-requests", "8"],
                                   {"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1",
                                    "TANDEM_FORCE_STREAM_INTERVAL": "3"}),
                # SGLang's --incremental-streaming-output, its deltas under chunked prefill and retraction
                "tiny_incremental_retract": (["--model-path", tiny, *TINY_ARGS, "--chunked-prefill-size", "16",
                                              "--incremental-streaming-output"], {"TANDEM_TEST_RETRACT": "1"}),
                # SmolLM2 dequantized (the reference path its tests compare with transformers' fp32); the
                # quantized default is compared with it in tests/runtime/model/test_gguf_quantized.py
                "smol": ([*SMOL_ARGS], None),
                # speculative decoding (NGRAM): plain, under retraction with and without overlap, and
                # switched off above two running requests
                "tiny_ngram": (["--model-path", tiny, *TINY_ARGS, *NGRAM], {"TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_ngram_sequential_chunked_retract": (
                    ["--model-path", tiny, *TINY_ARGS, *NGRAM, "--chunked-prefill-size", "16",
                     "--disable-overlap-schedule"], {"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_ngram_overlap_chunked_retract": (
                    ["--model-path", tiny, *TINY_ARGS, *NGRAM, "--chunked-prefill-size", "16"],
                    {"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_ngram_disable_2": (["--model-path", tiny, *TINY_ARGS, *NGRAM,
                                          "--speculative-disable-batch-size", "2"], {"TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_strict_thinking": (["--model-path", tiny, *TINY_ARGS, "--reasoning-parser", "deepseek-r1",
                                          "--enable-strict-thinking", "--constrained-json-disable-any-whitespace"],
                                         {"TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_reasoning": (["--model-path", tiny, *TINY_ARGS, "--reasoning-parser", "qwen3"], None),
                # tool calling: a tiny Qwen2 with a Qwen2.5-style tools template and the qwen25 parser
                "tiny_tools": (["--model-path", tiny_model_dir("qwen2"), *TINY_ARGS, "--tool-call-parser", "qwen25",
                                "--chat-template", TOOLS_TEMPLATE, "--constrained-json-disable-any-whitespace"], None),
                # weight updates and pause change the server for whoever comes next: one of their own
                "tiny_rl": (["--model-path", tiny, *TINY_ARGS, "--weight-version", "v0"], None),
                "tiny_embedding": (["--model-path", embedder(), *TINY_ARGS, "--is-embedding"], None),
                "smol_ngram": ([*SMOL_ARGS, *NGRAM], None),
                # STANDALONE: the draft is the tiny model cut to its first layer (SmolLM2: first 6 of 30)
                "tiny_standalone": (["--model-path", tiny, *TINY_ARGS, *standalone(tiny, 1)],
                                    {"TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_standalone_overlap_chunked_retract": (
                    ["--model-path", tiny, *TINY_ARGS, *standalone(tiny, 1), "--chunked-prefill-size", "16"],
                    {"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "tiny_standalone_sequential_retract": (
                    ["--model-path", tiny, *TINY_ARGS, *standalone(tiny, 1), "--disable-overlap-schedule"],
                    {"TANDEM_TEST_RETRACT": "1", "TANDEM_DEBUG_FUTURE_MAP": "1"}),
                "smol_standalone": ([*SMOL_ARGS,
                                     *standalone(None, 6)], None),
            }
            if name in failed:  # one failed start fails every later test that needs it at once
                pytest.fail(f"the {name} server did not start: {failed[name]}")
            args, env = configs[name]
            evict_for(name)
            try:
                started[name] = start_server(args, str(logs / f"{name}.log"), env)
            except RuntimeError as exc:
                failed[name] = exc
                raise
        return started[name]

    yield get
    for name in list(started):  # every server stops, whichever leaked
        stop(name)
    assert not leaks, leaks


@pytest.fixture(scope="session")
def tiny_server(servers):
    return servers("tiny")


@pytest.fixture(scope="session")
def smol_server(servers):
    return servers("smol")


@pytest.fixture(scope="session")
def grpc_server(tmp_path_factory, tiny_model_dir):
    """A tiny-model server that also serves gRPC (both services), with strict thinking and a
    reasoning parser for the reasoning controls; `.grpc_target` is its host:port."""
    from tandem.runtime.launcher import free_port

    port = free_port()
    logs = tmp_path_factory.mktemp("grpc_logs")
    handle = start_server(["--model-path", tiny_model_dir("llama"), *TINY_ARGS, "--grpc-port", str(port),
                           "--enable-strict-thinking", "--reasoning-parser", "deepseek-r1",
                           "--constrained-json-disable-any-whitespace"], str(logs / "grpc.log"),
                          {"TANDEM_DEBUG_FUTURE_MAP": "1"})
    handle.grpc_target = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield handle
    handle.stop()

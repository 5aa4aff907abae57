"""CLI flags and TOML presets build the same frozen ServerArgs; bad values name the argument."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from tandem.runtime import server_args as server_args_module
from tandem.runtime.server_args import DEFAULT_CONFIG, ServerArgs


def _cli(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def test_cli_and_toml_build_the_same_args(tmp_path):
    toml = tmp_path / "preset.toml"
    toml.write_text('[model]\ndtype = "float32"\n[server]\nport = 31234\nchunked_prefill_size = 64\n'
                    'disable_radix_cache = true\nschedule_policy = "lpm"\n')
    from_cli = _cli(["--dtype", "float32", "--port", "31234", "--chunked-prefill-size", "64",
                     "--disable-radix-cache", "--schedule-policy", "lpm"])
    assert ServerArgs.from_toml(toml) == from_cli
    assert _cli(["--config", str(toml), "--port", "1"]).port == 1  # flags override the preset
    with pytest.raises(dataclasses.FrozenInstanceError):
        from_cli.port = 2  # type: ignore[misc]


def test_incremental_streaming_output_from_cli_toml_and_keywords(tmp_path):
    """SGLang's --incremental-streaming-output (an SGLang launch command that used it exited with
    'unrecognized arguments'): off by default, a flag, a TOML bool and an Engine keyword."""
    assert not ServerArgs().incremental_streaming_output
    toml = tmp_path / "preset.toml"
    toml.write_text("[server]\nincremental_streaming_output = true\n")
    assert _cli(["--incremental-streaming-output"]) == ServerArgs.from_toml(toml) == ServerArgs(
        incremental_streaming_output=True)
    toml.write_text('incremental_streaming_output = "true"\n')
    with pytest.raises(ValueError, match="^incremental_streaming_output = 'true': expected bool, got str$"):
        ServerArgs.from_toml(toml)


def test_default_preset_loads_and_bad_values_name_the_argument():
    assert ServerArgs.from_toml(DEFAULT_CONFIG).port == 30000
    with pytest.raises(ValueError, match="^--schedule-policy: 'random' is not one of fcfs, lpm$"):
        ServerArgs(schedule_policy="random")
    with pytest.raises(ValueError, match="not_a_flag"):
        ServerArgs.from_dict({"not_a_flag": 1})


def test_speculative_flags():
    args = _cli(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
                 "--speculative-disable-batch-size", "8"])
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens, args.speculative_disable_batch_size) == (
        "NGRAM", 6, 8)
    for bad, fragment in [({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm: invalid value 'EAGLE'"),
                          ({"speculative_algorithm": "STANDALONE"}, "--speculative-draft-model-path is needed"),
                          ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "d"},
                           "--speculative-draft-model-path is needed by, and only by"),
                          ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "d",
                            "speculative_num_steps": 5}, "--speculative-num-steps 5 must be"),
                          ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1},
                           "--speculative-num-draft-tokens: invalid value 1"),
                          ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
                            "speculative_ngram_max_match_window_size": 2}, "--speculative-ngram-min-match-window-size: invalid value 5")]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            ServerArgs(**bad)


def test_sampling_defaults_source():
    assert ServerArgs().sampling_defaults == "model"  # SGLang's default
    assert _cli(["--sampling-defaults", "openai"]).sampling_defaults == "openai"
    with pytest.raises(ValueError, match="--sampling-defaults: 'hf' is not one of"):
        ServerArgs(sampling_defaults="hf")


def test_reasoning_parser_names():
    assert _cli(["--reasoning-parser", "deepseek-r1"]).reasoning_parser == "deepseek-r1"
    with pytest.raises(ValueError, match="--reasoning-parser: 'r2' is not one of"):
        ServerArgs(reasoning_parser="r2")


def test_parallelism_flags():
    args = _cli(["--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000",
                 "--dist-timeout", "60"])
    assert (args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr, args.dist_timeout) == (
        4, 2, 1, "10.0.0.1:5000", 60)
    assert _cli(["--allow-auto-truncate"]).allow_auto_truncate and not _cli([]).allow_auto_truncate
    for bad, fragment in [({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "--tp-size 3 must be a multiple of --nnodes 2"),
                          ({"tp_size": 2, "nnodes": 2}, "--dist-init-addr (HOST:PORT on node 0) is needed"),
                          ({"node_rank": 1}, "--node-rank: invalid value 1"),
                          ({"dist_init_addr": "host"}, "--dist-init-addr: invalid value 'host'"),
                          ({"dist_init_addr": "h:99999"}, "--dist-init-addr: invalid value 'h:99999'"),
                          ({"dist_init_addr": "h:0"}, "--dist-init-addr: invalid value 'h:0'"),
                          ({"dist_timeout": 0}, "--dist-timeout: invalid value 0"),
                          ({"tp_size": 2, "speculative_algorithm": "NGRAM"},
                           "--speculative-algorithm NGRAM is not available with --tp-size 2")]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            ServerArgs(**bad)


def test_kv_cache_dtype():
    assert _cli(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    assert ServerArgs().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="--kv-cache-dtype: 'fp8' is not one of"):
        ServerArgs(kv_cache_dtype="fp8")
    assert ServerArgs(kv_cache_dtype="fp8_e5m2", attention_backend="triton").kv_cache_dtype == "fp8_e5m2"


def test_an_sglang_launch_command_starts_tandem():
    """SGLang's spellings (--model, --tp, half, torch_native) and its flags that change nothing
    here (logged as ignored) parse; a parallelism flag above 1 is refused naming it."""
    from tandem.runtime import sglang_flags

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model", "m", "--tp", "1", "--dtype", "half", "--attention-backend", "torch_native",
                            "--disable-cuda-graph", "--trust-remote-code", "--cuda-graph-max-bs", "8", "--dp", "1",
                            "--enable-metrics", "--mem-fraction-static", "0.85"])
    notes = sglang_flags.check(ns)
    args = ServerArgs.from_cli_args(ns)
    assert (args.model_path, args.tp_size, args.dtype, args.attention_backend) == ("m", 1, "float16", "torch")
    assert any(n.startswith("--disable-cuda-graph ignored") for n in notes) and len(notes) == 4
    with pytest.raises(ValueError, match="^--dp-size: tandem runs one rank of it, got 2"):
        sglang_flags.check(parser.parse_args(["--dp", "2"]))
    for argv, reason in ((["--modelopt-quant", "fp8"], "no ModelOpt"), (["--lora-paths", "a=/x"], "no LoRA"),
                         (["--enable-lora"], "no LoRA")):  # they would change the answer: refused, saying why
        with pytest.raises(ValueError, match=f"^{argv[0]}: .*{reason}"):
            sglang_flags.check(parser.parse_args(argv))
    # --quantization is a field: the GGUF values are served, SGLang's others refused naming those
    assert ServerArgs.from_cli_args(parser.parse_args(["--quantization", "gguf"])).quantization == "gguf"
    assert ServerArgs.from_cli_args(parser.parse_args(["--quantization", "none"])).quantization == "none"
    with pytest.raises(ValueError, match="^--quantization: 'fp8' is not served; tandem serves gguf .* and none"):
        ServerArgs.from_cli_args(parser.parse_args(["--quantization", "fp8"]))
    # SGLang's parser takes unambiguous prefixes (its docs write --mem-frac), and its long names
    ns = parser.parse_args(["--mem-frac", "0.5", "--data-parallel-size", "1", "--priority-preemption"])
    assert ServerArgs.from_cli_args(ns).mem_fraction_static == 0.5
    assert any("now the default" in n for n in sglang_flags.check(ns))



def test_sglangs_flags_as_engine_keywords():
    from tandem.runtime import sglang_flags

    rest, notes = sglang_flags.engine_kwargs({"max_total_tokens": 4000, "disable_cuda_graph": True, "dp_size": 1,
                                              "enable_torch_compile": False, "cuda_graph_max_bs": 8})
    assert rest == {"max_total_tokens": 4000}
    assert [n.split(" ignored")[0] for n in notes] == ["--disable-cuda-graph", "--cuda-graph-max-bs"]
    with pytest.raises(ValueError, match="^--dp-size: tandem runs one rank of it, got 2"):
        sglang_flags.engine_kwargs({"dp_size": 2})


@pytest.mark.parametrize("bad, fragment", [
    ({"mem_fraction_static": 1.5}, "--mem-fraction-static: invalid value 1.5"),
    ({"mem_fraction_static": 0.0}, "--mem-fraction-static: invalid value 0.0"),
    ({"context_length": 0}, "--context-length: invalid value 0"),
    ({"max_total_tokens": -1}, "--max-total-tokens: invalid value -1"),
    ({"port": 70000}, "--port: invalid value 70000"),
    ({"request_timeout": -1.0}, "--request-timeout: invalid value -1.0"),  # every queued request would expire
    ({"request_timeout": float("nan")}, "--request-timeout: invalid value nan"),  # would be off, unsaid
    ({"watchdog_timeout": float("nan")}, "--watchdog-timeout: invalid value nan"),
    ({"health_generate_timeout": 0.0}, "--health-generate-timeout: invalid value 0.0"),
    ({"grammar_compile_timeout": -5.0}, "--grammar-compile-timeout: invalid value -5.0"),
    ({"log_level": "loud"}, "--log-level: 'loud' is not one of"),
    ({"attention_backend": "flashinfer"}, "--attention-backend: 'flashinfer' is not one of auto, torch, cpu, triton"),
    ({"max_prefill_tokens": 0}, "--max-prefill-tokens: invalid value 0"),  # admitted no prompt, looked healthy
    ({"max_prefill_tokens": -8}, "--max-prefill-tokens: invalid value -8"),
    ({"max_connections": 0}, "--max-connections: invalid value 0"),  # refused every connection
])
def test_bad_values_name_the_flag(bad, fragment):
    with pytest.raises(ValueError, match="^" + fragment):
        ServerArgs(**bad)


def test_priority_scheduling_preempts_unless_disabled_as_sglang():
    assert not ServerArgs(enable_priority_scheduling=True).disable_priority_preemption
    assert _cli(["--enable-priority-scheduling", "--disable-priority-preemption"]).disable_priority_preemption
    assert _cli(["--abort-on-priority-when-disabled"]).abort_on_priority_when_disabled  # SGLang's flag launches


@pytest.mark.parametrize("toml, fragment", [
    ('[server]\ndisable_radix_cache = "false"\n', "disable_radix_cache = 'false': expected bool, got str"),
    ("[server]\nmax_running_requests = 1.5\n", "max_running_requests = 1.5: expected int, got float"),
    ('[server]\nport = "30125"\n', "port = '30125': expected int, got str"),
    ("[server]\nport = true\n", "port = True: expected int, got bool"),
    ("[model]\nmodel_path = 3\n", "model_path = 3: expected str | None, got int"),
    ("[sever]\nport = 1\n", r"unknown table\(s\) \[sever\]"),
    ("[server]\nextra = {foo = 1}\n", "extra"),  # no catch-all field keeps what nothing reads
])
def test_toml_values_must_have_the_fields_type(tmp_path, toml, fragment):
    """TOML has its own types: "false" is a truthy string (it switched the radix cache off), 1.5
    crashed the scheduler later, and a misspelt table was dropped without a word."""
    path = tmp_path / "preset.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=fragment):
        ServerArgs.from_toml(path)


def test_toml_floats_take_ints_and_a_missing_preset_names_config(tmp_path):
    path = tmp_path / "preset.toml"
    path.write_text("[server]\nwatchdog_timeout = 60\nrequest_timeout = 5\n")
    assert ServerArgs.from_toml(path) == ServerArgs(watchdog_timeout=60.0, request_timeout=5.0)
    with pytest.raises(ValueError, match="^--config '/nonexistent.toml': No such file"):
        ServerArgs.from_toml("/nonexistent.toml")
    path.write_text("[server\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        ServerArgs.from_toml(path)


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    """Without CUDA the first request killed the scheduler (Triton needs CUDA tensors)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(server_args_module, "cuda_available", lambda: False)
    for device in ("auto", "cpu"):
        with pytest.raises(ValueError, match="^--attention-backend triton needs a CUDA device"):
            ServerArgs(attention_backend="triton", device=device)
    assert ServerArgs(attention_backend="triton", device="cuda").attention_backend == "triton"
    assert ServerArgs(attention_backend="cpu").attention_backend == "cpu"
    monkeypatch.setattr(server_args_module, "cuda_available", lambda: True)
    assert ServerArgs(attention_backend="triton").attention_backend == "triton"
    monkeypatch.setattr(server_args_module, "cuda_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ServerArgs(attention_backend="triton", device="cpu").attention_backend == "triton"


def test_the_random_seed_is_drawn_once_per_launch_unless_given(caplog):
    """SGLang's: seedless sampling must not repeat from launch to launch (the default was 0)."""
    from tandem.runtime.launcher import resolve_random_seed

    assert ServerArgs().random_seed is None and _cli([]) == ServerArgs.from_toml(DEFAULT_CONFIG)
    with caplog.at_level("INFO"):
        drawn = [resolve_random_seed(ServerArgs()).random_seed for _ in range(3)]
    assert all(0 <= seed <= 1 << 30 for seed in drawn) and len(set(drawn)) > 1
    assert f"random seed: {drawn[0]} (drawn for this launch" in caplog.text
    assert resolve_random_seed(_cli(["--random-seed", "7"])).random_seed == 7
    assert resolve_random_seed(ServerArgs(random_seed=0)).random_seed == 0
    # every node of a multi-node job draws alone, and the TP ranks must agree: 0 unless given
    multi = ServerArgs(tp_size=2, nnodes=2, dist_init_addr="h:1")
    assert resolve_random_seed(multi).random_seed == 0


def test_chat_template_must_be_a_file(tmp_path):
    """SGLang's built-in template names (chatml, llama-2, ...) are not served: a clear error naming
    the flag at start-up, not a traceback."""
    with pytest.raises(ValueError, match="--chat-template: 'chatml' is not a Jinja template file"):
        ServerArgs(chat_template="chatml")
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert ServerArgs(chat_template=str(tmp_path / "t.jinja")).chat_template == str(tmp_path / "t.jinja")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_total_tokens": "x"}, "--max-total-tokens: expected int | None, got str 'x'"),
    ({"disable_radix_cache": "false"}, "--disable-radix-cache: expected bool, got str 'false'"),
    ({"api_key": 5}, "--api-key: expected str | None, got int 5"),
    ({"max_running_requests": True}, "--max-running-requests: expected int, got bool True"),
])
def test_a_python_callers_value_of_the_wrong_type_names_the_flag(kwargs, message):
    """Engine(**kwargs) builds ServerArgs from Python values: max_total_tokens="x" was a TypeError
    ("'>=' not supported between 'str' and 'int'") naming nothing."""
    with pytest.raises(ValueError) as exc:
        ServerArgs(**kwargs)
    assert str(exc.value) == message


def test_a_path_object_is_taken_as_its_string():
    from pathlib import Path

    args = ServerArgs(model_path=Path("/models/m"), mem_fraction_static=1)  # an int is a float too
    assert args.model_path == "/models/m" and type(args.model_path) is str


def test_sglangs_determinism_flags_are_taken():
    """--enable-deterministic-inference is a ServerArgs field (the triton backend's extend follows
    it; CPU is deterministic without it); --enable-fp32-lm-head is logged: the head always is."""
    from tandem.runtime import sglang_flags

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--enable-deterministic-inference", "--enable-fp32-lm-head"])
    assert ns.enable_deterministic_inference is True
    notes = sglang_flags.check(ns)
    assert [n.split(" ignored")[0] for n in notes] == ["--enable-fp32-lm-head"]
    assert "fp32 logits" in notes[0]

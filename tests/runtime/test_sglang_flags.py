"""Every launch flag of SGLang 0.5.23 (tests/runtime/data/sglang_flags_0.5.23.json, extracted from
SGLang's own parser by data/extract_sglang_flags.py) goes through `tandem serve`'s argument parsing
with a value SGLang's parser accepts, and comes out implemented (a ServerArgs field), ignored
(logged with the reason) or refused (exit 2 with the reason): never "unrecognized arguments"."""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from pathlib import Path

import pytest

from tandem.launch import server
from tandem.runtime import sglang_flags
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.sglang_flag_tables import SINGLE_RANK

DATA = json.loads((Path(__file__).parent / "data" / "sglang_flags_0.5.23.json").read_text())
FIELDS = {f.name for f in dataclasses.fields(ServerArgs)} | {"config"}  # --config: tandem's TOML preset
LEGACY = {"--cuda-graph-max-bs", "--priority-preemption"}  # older spellings tandem still takes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem serve")
    ServerArgs.add_cli_args(parser)
    return parser


PARSER = _parser()


def _status(name: str) -> str:
    action = PARSER._option_string_actions.get(name)
    if action is None:
        return "unknown"
    return "implemented" if action.dest in FIELDS else sglang_flags.status(name)


@pytest.fixture
def serve(monkeypatch, capsys):
    """`tandem serve ARGV` up to the point where it would start: (ServerArgs, log notes), or the
    exit status and argparse's message."""
    started = []
    monkeypatch.setattr(server, "local_checkpoints", lambda args: args)
    monkeypatch.setattr(server, "run_server", lambda args, notes: started.append((args, notes)) or 0)

    def run(argv: list[str]):
        started.clear()
        try:
            assert server.main(argv) == 0
        except SystemExit as exc:
            return exc.code, capsys.readouterr().err
        return started[0]
    return run


def test_the_data_is_sglang_0_5_23s_531_flags():
    assert (DATA["sglang_version"], DATA["count"], len(DATA["flags"])) == ("0.5.23", 531, 531)
    sources = collections.Counter(f["source"] == "server_args.py" for f in DATA["flags"])
    assert sources == {False: 522, True: 9}  # arg_groups/fields/*.py, and server_args.py by hand


def test_every_sglang_flag_has_exactly_one_status():
    counts = collections.Counter()
    for f in DATA["flags"]:
        statuses = {_status(name) for name in (f["flag"], *f["aliases"])}
        assert len(statuses) == 1 and "unknown" not in statuses and "" not in statuses, (f["flag"], statuses)
        counts[statuses.pop()] += 1
    assert sum(counts.values()) == 531 and all(counts[s] for s in ("implemented", "ignored", "refused", "single-rank"))
    print(dict(counts))


def test_the_tables_take_each_flag_as_sglangs_parser_does():
    """A value flag takes a value (as many as SGLang's nargs), a switch none; the tables name no
    flag that SGLang lacks (but tandem's own older spellings) and none twice."""
    by_name = {f["flag"]: f for f in DATA["flags"]}
    for flag in sglang_flags.FLAGS.values():
        if flag.name in LEGACY:
            continue
        sg = by_name.get(flag.name)
        assert sg is not None, f"{flag.name} is not one of SGLang 0.5.23's flags"
        negated = [a for a in sg["aliases"] if a.startswith("--no-")]
        want = sglang_flags.BOOL if negated else sg["nargs"] if sg["takes_value"] else sglang_flags.SWITCH
        assert flag.nargs == want, (flag.name, flag.nargs, want)
        assert set(flag.names) == {sg["flag"], *sg["aliases"]} - set(negated), flag.name
        for value in flag.asks_nothing:  # the values that are accepted must be SGLang's too
            assert sg["choices"] is None or value in sg["choices"], (flag.name, value)
    for dest, names in SINGLE_RANK.items():
        assert {by_name[names[0]]["flag"], *by_name[names[0]]["aliases"]} <= set(names)  # tandem adds --dp
        assert by_name[names[0]]["dest"] == dest


@pytest.mark.parametrize("spelling, sample, status", [
    (name, [] if name.startswith("--no-") else f["sample"], _status(name))
    for f in DATA["flags"] for name in (f["flag"], *f["aliases"])])
def test_each_sglang_flag_parses_through_tandem_serve(serve, spelling, sample, status):
    model = [] if spelling in ("--model-path", "--model") else ["--model-path", "m"]
    out = serve([*model, spelling, *sample])
    exited = isinstance(out[0], int)
    if exited:  # exit 2 with argparse's message: a refusal, or a value ServerArgs refuses
        code, err = out
        assert code == 2 and "unrecognized arguments" not in err and "ambiguous option" not in err, err
        assert "expected one argument" not in err and "expected at least one" not in err, err
    if status in ("ignored", "refused"):
        flag = sglang_flags.FLAGS[_canonical(spelling)]
        shown = _negated(flag.name) if spelling.startswith("--no-") else flag.name
        if exited:
            assert flag.refused and f"error: {shown}: {flag.reason}" in out[1], out[1]
        elif flag.refused:  # a value that asks for what tandem does anyway: accepted and logged
            assert sample == [] or sample[0] in flag.asks_nothing
            assert any(n.startswith(shown) and "it asks for what tandem does" in n for n in out[1]), out[1]
        else:
            assert f"{shown} ignored: {flag.reason}" in out[1]
    elif status == "single-rank":
        assert not exited and sample == ["1"] and out[1] == []
    else:
        assert status == "implemented"
        if exited:  # ServerArgs refuses this value of its field, naming the flag
            assert _flag_named(out[1], spelling), out[1]
        else:
            action = PARSER._option_string_actions[spelling]
            assert action.dest == "config" or getattr(out[0], action.dest) is not None


def _canonical(spelling: str) -> str:
    for flag in sglang_flags.FLAGS.values():
        if spelling in flag.names or spelling == _negated(flag.name):
            return flag.name
    raise KeyError(spelling)


def _negated(name: str) -> str:
    return "--no-" + name.removeprefix("--")


def _flag_named(err: str, spelling: str) -> bool:
    action = PARSER._option_string_actions[spelling]
    return any(name in err for name in (*action.option_strings, "--" + action.dest.replace("_", "-")))


def test_refused_flags_say_why_and_neutral_values_pass(serve):
    code, err = serve(["--enable-multimodal"])
    assert code == 2 and "--enable-multimodal: tandem serves text decoders" in err
    code, err = serve(["--disaggregation-mode", "prefill"])
    assert code == 2 and "--disaggregation-mode: tandem runs as one whole server" in err
    code, err = serve(["--load-format", "dummy"])
    assert code == 2 and "--load-format: tandem reads safetensors folders and GGUF files" in err
    args, notes = serve(["--load-format", "safetensors", "--disaggregation-mode", "null", "--no-enable-tf32-matmul"])
    assert [n.split(" ignored")[0] for n in notes] == [
        "--load-format safetensors", "--no-enable-tf32-matmul", "--disaggregation-mode null"]  # in the tables' order
    code, err = serve(["--enable-tf32-matmul"])
    assert code == 2 and "--enable-tf32-matmul: tandem's numerics" in err
    code, err = serve(["--attn-dp-size", "2"])
    assert code == 2 and "--attn-dp-size: tandem runs one rank of it, got 2" in err


def test_sglang_launch_lines_from_the_issue_start_tandem(serve):
    args, notes = serve(["--model", "m", "--tool-call-parser", "qwen25", "--page-size", "16", "--enable-mixed-chunk",
                         "--log-requests-level", "1", "--cuda-graph-max-bs-decode", "64", "--disable-decode-cuda-graph",
                         "--enable-return-hidden-states", "--nccl-init-addr", "10.0.0.1:5000", "--weight-version", "v2",
                         "--cuda-graph-bs-decode", "1", "2", "4"])
    assert (args.tool_call_parser, args.log_requests_level, args.dist_init_addr, args.weight_version) == (
        "qwen25", 1, "10.0.0.1:5000", "v2")
    assert [n.split(" ignored")[0] for n in notes] == [
        "--cuda-graph-max-bs-decode", "--cuda-graph-bs-decode", "--disable-decode-cuda-graph", "--enable-mixed-chunk",
        "--page-size", "--enable-return-hidden-states"]
    code, err = serve(["--revision", "abc123"])
    assert code == 2 and "--revision: tandem serves the checkpoint as it is on disk" in err


def test_sglang_flags_as_engine_keywords():
    rest, notes = sglang_flags.engine_kwargs({"max_total_tokens": 8, "enable_lora": False, "page_size": 16,
                                              "load_format": "auto", "attn_dp_size": 1, "enable_tf32_matmul": False})
    assert rest == {"max_total_tokens": 8}
    assert [n.split(" ignored")[0] for n in notes] == ["--page-size", "--load-format auto", "--no-enable-tf32-matmul"]
    for kwargs, message in (({"enable_multimodal": True}, "^--enable-multimodal: tandem serves text decoders"),
                            ({"lora_paths": ["a=/x"]}, "^--lora-paths: tandem serves no LoRA"),
                            ({"moe_dp_size": 2}, "^--moe-dp-size: tandem runs one rank of it, got 2")):
        with pytest.raises(ValueError, match=message):
            sglang_flags.engine_kwargs(kwargs)

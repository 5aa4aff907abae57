"""The `tandem` command: its usage and exit codes, and `tandem generate` against transformers'
greedy output on the same checkpoint."""
from __future__ import annotations

import pytest
import torch

from tandem.launch.cli import main

pytestmark = pytest.mark.timeout(300)


def test_usage_and_unknown_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "tandem {serve,generate,bench}" in out and all(f"  {cmd} " in out for cmd in ("serve", "generate", "bench"))
    assert main([]) == 2  # nothing to do is a usage error, as argparse's
    for argv in (["bogus"], ["bench"], ["bench", "nope"]):
        assert main(argv) == 2 and "usage: tandem" in capsys.readouterr().err, argv


def test_bench_help_describes_every_benchmark(capsys):
    from tandem.launch.cli import _BENCHES

    assert main(["bench", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, (_, what) in _BENCHES.items():
        assert any(line.split() and line.split()[0] == name and what in line for line in lines), name


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0 and capsys.readouterr().out == f"tandem {version('tandem-serve')}\n"


def test_every_serve_flag_has_help_with_its_default_and_choices():
    """Generated from the one ServerArgs definition: the comment at each field, its default, its
    choices; a field without a comment would show only its default, so every field has one."""
    import argparse
    import dataclasses

    from tandem.runtime.server_args import _CHOICES, ServerArgs, _field_comments

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    helps = {a.dest: a.help for a in parser._actions}
    comments = _field_comments()
    for f in dataclasses.fields(ServerArgs):
        assert comments.get(f.name), f"ServerArgs.{f.name} has no comment to document --{f.name}"
        assert "default: " in helps[f.name] and comments[f.name] in helps[f.name].replace("%%", "%"), f.name
        for choice in _CHOICES.get(f.name, ()):
            assert str(choice) in helps[f.name], (f.name, choice)
    parser.format_help()  # argparse expands every help string: a stray % would raise here


def test_generate_prints_transformers_greedy_text(tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM

    from tandem.runtime.tokenizer import load_tokenizer

    path = tiny_model_dir("llama")
    tok = load_tokenizer(path)
    ids = tok.encode("hello world", add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    if tok.eos_token_id in want:  # the command stops at EOS
        want = want[:want.index(tok.eos_token_id)]
    assert main(["generate", "hello world", "--model-path", path, "--max-new-tokens", "6", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == tok.decode(want, skip_special_tokens=True) + "\n"


def test_a_benchmark_missing_its_packages_says_so_before_it_starts(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiohttp" else real(name, *a))
    assert main(["bench", "serving", "--help"]) == 2
    assert "tandem bench serving needs aiohttp: pip install 'tandem-serve[bench]'" in capsys.readouterr().err

"""The `tandem` command: its usage and exit codes, and `tandem generate` against transformers'
greedy output on the same checkpoint."""
from __future__ import annotations

import pytest
import torch

from tandem.launch.cli import main

pytestmark = pytest.mark.timeout(300)


def test_usage_and_unknown_commands(capsys):
    assert main(["--help"]) == 0 and "tandem {serve,generate,bench}" in capsys.readouterr().out
    assert main([]) == 2  # nothing to do is a usage error, as argparse's
    for argv in (["bogus"], ["bench"], ["bench", "nope"]):
        assert main(argv) == 2 and "usage: tandem" in capsys.readouterr().err, argv


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

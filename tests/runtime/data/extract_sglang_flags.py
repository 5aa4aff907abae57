"""Extracts SGLang's launch flags into sglang_flags_<version>.json, the test data of
tests/runtime/test_sglang_flags.py.

How the data was made (not run by the tests):

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl
    cd /tmp/sgl && unzip -q sglang-0.5.23-*.whl
    python tests/runtime/data/extract_sglang_flags.py /tmp/sgl > tests/runtime/data/sglang_flags_0.5.23.json

It imports the release's own `sglang.srt.server_args` (torch, transformers and msgspec installed;
modules it imports that are absent, e.g. pybase64, are stubbed) and builds SGLang's real parser
with `ServerArgs.add_cli_args`: one entry per argparse action (a flag and its aliases), whether it
takes a value and how many (argparse's nargs), its choices, and a sample value that SGLang's own
parser accepts (each sample is parsed back through it here). `source` says where the flag is
declared: `fields/<namespace>` (a dataclass field in arg_groups/fields/) or `server_args.py`
(registered there by hand: dynamic choices, --config, deprecated spellings).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import io
import json
import sys
from pathlib import Path
from unittest import mock

# strings tried, in order, as the value of a flag whose type is not plain str/int/float
_CANDIDATES = ("1", "0.5", "[]", "{}", "x")


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A MagicMock module for each top-level name in `names` (SGLang's optional imports)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module

    def exec_module(self, module) -> None:
        pass


def _parser(root: Path):
    sys.path.insert(0, str(root))
    stubs = _Stubs(set())
    sys.meta_path.insert(0, stubs)
    while True:
        try:
            from sglang.srt.server_args import ServerArgs
            break
        except ModuleNotFoundError as exc:  # stub what the release imports but this machine lacks
            if exc.name is None or exc.name.split(".")[0] in stubs.names or exc.name.startswith("sglang"):
                raise
            stubs.names.add(exc.name.split(".")[0])
            for name in [m for m in sys.modules if m.startswith("sglang")]:
                del sys.modules[name]
    from sglang.srt.arg_groups.arg_utils import add_cli_args_from_dataclass, namespace_of

    full = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(full)
    generated = argparse.ArgumentParser(add_help=False)
    add_cli_args_from_dataclass(generated, ServerArgs)
    from_fields = {a.option_strings[0] for a in generated._actions}
    return full, from_fields, namespace_of(ServerArgs), sorted(stubs.names)


def _accepts(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """SGLang's parser takes `argv` (after the one flag it requires, --model-path)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(["--model-path", "m", *argv])
    except SystemExit:
        return False
    return True


def _sample(parser: argparse.ArgumentParser, action: argparse.Action) -> list[str]:
    """The value words after the flag: none for a switch, else a value SGLang's parser takes."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return []
    if action.choices:
        options = [str(c) for c in _choices(action) if c is not None]
        picks = [c for c in options if c != str(action.default)] + options  # prefer a non-default value
    elif action.type is int:
        picks = ["1"]
    elif action.type is float:
        picks = ["0.5"]
    elif action.type in (None, str):
        picks = [str(action.default)] if isinstance(action.default, str) and action.default else ["x"]
    else:
        picks = list(_CANDIDATES)
    for pick in picks:
        if _accepts(parser, [flag, pick]):
            return [pick]
    raise SystemExit(f"no sample value found for {flag}")


def _choices(action: argparse.Action) -> list:
    """In a stable order (--sampling-backend's are a set)."""
    choices = action.choices
    return sorted(choices, key=str) if isinstance(choices, (set, frozenset)) else list(choices)


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def main() -> None:
    root = Path(sys.argv[1])
    parser, from_fields, namespaces, stubbed = _parser(root)
    flags = []
    for action in parser._actions:
        if not action.option_strings:
            continue
        name, *aliases = action.option_strings
        sample = _sample(parser, action)
        assert _accepts(parser, [name, *sample]), name
        flags.append({
            "flag": name,
            "aliases": aliases,
            "dest": action.dest,
            "takes_value": action.nargs != 0,
            "nargs": action.nargs,
            "choices": None if action.choices is None else [_jsonable(c) for c in _choices(action)],
            "sample": sample,
            "default": _jsonable(action.default),
            "source": f"fields/{namespaces.get(action.dest, '?')}" if name in from_fields else "server_args.py",
            "help": " ".join((action.help or "").split())[:120],
        })
    wheel = next(root.glob("sglang-*.whl"), None)
    import sglang

    out = {
        "sglang_version": sglang.__version__,
        "source": "PyPI release wheel " + (wheel.name if wheel else "sglang"),
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest() if wheel else None,
        "how": "tests/runtime/data/extract_sglang_flags.py (SGLang's own ServerArgs.add_cli_args parser)",
        "stubbed_imports": stubbed,
        "count": len(flags),
        "flags": flags,
    }
    head = json.dumps({k: v for k, v in out.items() if k != "flags"}, indent=1)[:-2]  # one flag a line
    rows = ",\n  ".join(json.dumps(f) for f in flags)
    sys.stdout.write(f'{head},\n "flags": [\n  {rows}\n ]\n}}\n')


if __name__ == "__main__":
    main()

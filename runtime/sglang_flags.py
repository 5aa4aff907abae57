"""SGLang's launch flags that tandem takes without a ServerArgs field, so that an SGLang launch
command (a benchmark harness's, a deployment script's) either starts tandem unchanged or stops at
once saying why; also tandem's own retired flags. On the CLI, and as `Engine(**kwargs)` keywords
(SGLang's Engine takes its ServerArgs fields so); a TOML preset names ServerArgs fields.

Every flag of SGLang 0.5.23 is one of: a ServerArgs field (implemented); in IGNORED (it changes
nothing here: accepted and logged, with the reason); in REFUSED (it would change answers or asks
for what tandem lacks: refused at start, with the reason and what to use instead); or a
parallelism size in SINGLE_RANK (accepted at 1, refused above). The tables, grouped by reason,
are in sglang_flag_tables.py; tests/runtime/test_sglang_flags.py checks them against the flags
extracted from SGLang's own parser.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from tandem.runtime.sglang_flag_tables import ALIASES, IGNORED, REFUSED, SINGLE_RANK

SWITCH, BOOL = 0, "bool"  # a store_true flag; a flag with its --no- form (argparse.BooleanOptionalAction)


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # SGLang's name first, then its aliases
    nargs: Any  # SWITCH, BOOL, or argparse's nargs for a value: None (one), "+", "*", "?"
    reason: str
    refused: bool
    asks_nothing: frozenset[str] = frozenset()  # REFUSED values that ask for what tandem does anyway

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        return "sglang_" + self.keyword

    @property
    def keyword(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def spelled(self, value: Any) -> str:
        return "--no-" + self.name.removeprefix("--") if self.nargs == BOOL and value is False else self.name

    def refuses(self, value: Any) -> bool:
        if not self.refused or value is None or (self.nargs == BOOL and value is False):
            return False
        return not (isinstance(value, str) and value in self.asks_nothing)


def _parse(spec: str, reason: str, refused: bool) -> Flag:
    """One word of a table: see sglang_flag_tables.py for the notation."""
    nargs: Any = SWITCH
    asks_nothing: frozenset[str] = frozenset()
    if "=" in spec:
        spec, values = spec.split("=", 1)
        nargs, asks_nothing = None, frozenset(v for v in values.split("|") if v)
    elif spec[-1] in "+*?":
        spec, nargs = spec[:-1], spec[-1]
    if spec.startswith("--[no-]"):
        spec, nargs = "--" + spec.removeprefix("--[no-]"), BOOL
    names = tuple(spec.split(","))
    if not all(n.startswith("--") for n in names) or (asks_nothing and not refused):
        raise ValueError(f"sglang_flag_tables: bad entry {spec!r}")
    return Flag(names, nargs, reason, refused, asks_nothing)


def _flags() -> dict[str, Flag]:
    flags: dict[str, Flag] = {}
    for table, refused in ((IGNORED, False), (REFUSED, True)):
        for reason, specs in table.items():
            for spec in specs.split():
                flag = _parse(spec, reason, refused)
                if flag.name in flags:
                    raise ValueError(f"sglang_flag_tables: {flag.name} is listed twice")
                flags[flag.name] = flag
    return flags


FLAGS: dict[str, Flag] = _flags()


def status(flag: str) -> str:
    """'ignored', 'refused' or 'single-rank' for a flag of these tables (any spelling), else ''."""
    for f in FLAGS.values():
        if flag in f.names or (f.nargs == BOOL and flag == "--no-" + f.name.removeprefix("--")):
            return "refused" if f.refused else "ignored"
    return "single-rank" if any(flag in names for names in SINGLE_RANK.values()) else ""


def add_args(parser: argparse.ArgumentParser) -> None:
    ignored = sum(not f.refused for f in FLAGS.values())
    group = parser.add_argument_group(
        "SGLang's other launch flags",
        f"{ignored} change nothing here: accepted and logged as ignored, with the reason. "
        f"{len(FLAGS) - ignored} would change the answers or ask for what tandem lacks: refused at start, with the "
        f"reason and what to use instead. The lists are in tandem.runtime.sglang_flag_tables.")
    for flag in FLAGS.values():
        if flag.nargs == SWITCH:
            kind: dict[str, Any] = {"action": "store_true"}
        elif flag.nargs == BOOL:
            kind = {"action": argparse.BooleanOptionalAction}
        else:
            kind = {"nargs": flag.nargs, **({"const": True} if flag.nargs == "?" else {})}
        group.add_argument(*flag.names, default=None, dest=flag.dest, help=argparse.SUPPRESS, **kind)
    for dest, names in SINGLE_RANK.items():
        group.add_argument(*names, type=int, default=None, dest=dest, metavar="1",
                           help="SGLang's: tandem runs one rank of it (1; above 1 is refused)")
    for alias, field in ALIASES.items():  # one more spelling of the field's own flag (its --help line shows it)
        action = next(a for a in parser._actions if a.dest == field)
        if alias in parser._option_string_actions:
            raise ValueError(f"sglang_flag_tables: {alias} is taken")
        action.option_strings.append(alias)
        parser._option_string_actions[alias] = action


def check(ns: argparse.Namespace) -> list[str]:
    """Refuses a flag that would change answers and a parallelism size above 1 (ValueError naming
    it); returns the ignored flags' log lines."""
    given = [(flag, value) for flag in FLAGS.values() if (value := getattr(ns, flag.dest, None)) is not None]
    for flag, value in given:
        if flag.refuses(value):
            raise ValueError(f"{flag.spelled(value)}: {flag.reason}")
    for dest, names in SINGLE_RANK.items():
        value = getattr(ns, dest, None)
        if value is not None and value != 1:
            why = "; data parallelism is the gateway's job (smg --dp-aware)" if dest == "dp_size" else ""
            raise ValueError(f"{names[0]}: tandem runs one rank of it, got {value}{why}")
    notes = []
    for flag, value in given:
        if flag.refused:  # a value that asks for what tandem does anyway
            shown = flag.spelled(value) + ("" if flag.nargs == BOOL else f" {value}")
            notes.append(f"{shown} ignored: it asks for what tandem does ({flag.reason})")
        else:
            notes.append(f"{flag.spelled(value)} ignored: {flag.reason}")
    return notes


def engine_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`Engine(**kwargs)`: the ServerArgs keywords, and the log lines of the flags above given
    by their keyword names (`disable_cuda_graph=True`; a switch set False is not given); a flag
    refused or a parallelism size above 1 is a ValueError."""
    keywords = {flag.keyword: flag for flag in FLAGS.values()}
    ns = argparse.Namespace(**{k: v for k, v in kwargs.items() if k in SINGLE_RANK})
    for key, value in kwargs.items():
        if key in keywords and not (keywords[key].nargs == SWITCH and value is False):
            setattr(ns, keywords[key].dest, value)
    rest = {k: v for k, v in kwargs.items() if k not in keywords and k not in SINGLE_RANK}
    return rest, check(ns)

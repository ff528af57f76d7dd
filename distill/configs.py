"""Checking config dataclasses against their annotations, with one wording (a leaf: imports
nothing of ours but `distill.errors`).

Every config is a dataclass beside its owner; its `__post_init__` calls `check_types(self)` and
then `require(...)` for the rules types cannot say. A field a command takes as an option is
declared with `option(default, help)`: the CLI generates the option from it (distill/cli_options.py),
so its default and help text are written once, on the field. A bad value raises `ConfigError`, which
knows the field, so each surface names it its own way: the library "`seq_len` must be ...",
the CLI "--seq-len must be ..." (`as_option`), a recipe "[corpus] seq_len must be ..."
(`in_section`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any, Literal

from distill.errors import DistillUserError


class ConfigError(DistillUserError):
    """A config field holds a value it cannot take; `field` names it, `problem` says the rest."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"`{field}` {problem}")

    def as_option(self) -> DistillUserError:
        """The same error named as the CLI option (`--seq-len`)."""
        return DistillUserError(f"--{self.field.replace('_', '-')} {self.problem}")

    def in_section(self, section: str) -> DistillUserError:
        """The same error named as a recipe key (`[corpus] seq_len`)."""
        return DistillUserError(f"[{section}] {self.field} {self.problem}")


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: tuple[str, ...] = (),
           default_factory: Any = dataclasses.MISSING):
    """A config field that is also a command-line option: `help` is its one line of documentation
    (the option's help); flags: the option's names when not only `--field-name` (e.g. ("--cache", "-c"))."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help, "flags": tuple(flags)})


def require(field: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise ConfigError("`field` must be {allowed}, got {value!r}") unless `ok`."""
    if not ok:
        raise ConfigError(field, f"must be {allowed}, got {value!r}")


def check_types(config) -> None:
    """Check each field of the dataclass instance `config` against its annotation: bool, int,
    float (an int is accepted), str, Path (a str is accepted), None in a union, Literal[...],
    tuple[...] and nested config dataclasses (checked by their own construction)."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        hint = hints[f.name]
        if not _matches(value, hint):
            raise ConfigError(f.name, f"must be {_describe(hint)}, got {value!r}")


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _matches(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is Path:
        return isinstance(value, (str, Path))
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args))
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint)
    return isinstance(value, origin or hint)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        # None is how the library leaves a field out; neither an option nor a TOML key can be given None
        described = " or ".join(_describe(a) for a in args if a is not type(None))
        return f"{described}, or leave it out" if type(None) in args else described
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path",
             type(None): "None"}
    if hint in names:
        return names[hint]
    if origin is tuple:
        return "a tuple"
    return getattr(hint, "__name__", str(hint))


def from_dict(cls, values: dict, section: str | None = None):
    """Build config `cls` from a mapping (a recipe section, a saved config), strictly: an unknown
    key is an error that lists the known ones. Errors name `[section] key` when `section` is given."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f"[{section}] " if section else ""
        raise DistillUserError(f"{where}unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except ConfigError as e:
        raise (e.in_section(section) if section else e) from None

"""Command-line options generated from config fields (`distill.configs.option`): each option is
declared once, on the field that holds it, with its default and help text; a command that takes a
config's options is a function of **values whose signature this module writes."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import typer

from distill.errors import DistillUserError

__all__ = ["config_parameters", "option_error", "option_name", "with_parameters"]


def config_parameters(fields: list[tuple[dataclasses.Field, Any]], *, skip=(), defaults: dict | None = None
                      ) -> list[inspect.Parameter]:
    """One typer option per (field, type hint), in order, but those named in `skip`; `defaults`
    overrides a field's default (a required field without one becomes a required option; a default
    of None makes the option optional, e.g. a tuple field whose config default the command leaves
    to the config when the option is not given)."""
    defaults = defaults or {}
    params = []
    for f, hint in fields:
        if f.name in skip:
            continue
        default = defaults[f.name] if f.name in defaults else _default(f)
        cli_type = _cli_type(hint)
        if default == () and typing.get_origin(cli_type) is not list:  # a tuple given as text (0.7,0.3): unset
            default = None
        if default is None and type(None) not in typing.get_args(cli_type):
            cli_type = Optional[cli_type]
        flags = f.metadata.get("flags") or (option_name(f),)
        if cli_type in (bool, Optional[bool]):  # Optional: unset unless --name or --no-name is given
            flags = (f"--{f.name.replace('_', '-')}/--no-{f.name.replace('_', '-')}",)
        info = typer.Option(default, *flags, help=f.metadata.get("help") or None, show_default=default is not ...)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=cli_type))
    return params


def with_parameters(*groups: list[inspect.Parameter]):
    """Give a command that takes **values the options of `groups` (lists of inspect.Parameter, e.g.
    `config_parameters(...)` and a function's own, from `inspect.signature(f).parameters.values()`)."""
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for group in groups for p in group]

    def decorate(command):
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def option_name(f: dataclasses.Field) -> str:
    """The option a user types for config field `f`: its first flag (`-k`, `--corpus`), else `--field-name`."""
    flags = f.metadata.get("flags")
    return flags[0] if flags else f"--{f.name.replace('_', '-')}"


def option_error(error, fields: list[tuple[dataclasses.Field, Any]]) -> DistillUserError:
    """`error` (a distill.configs.ConfigError) named as the option of the field it names, among
    `fields` (as `config_parameters` takes them); a field not among them: `--field-name`."""
    for f, _ in fields:
        if f.name == error.field:
            return DistillUserError(f"{option_name(f)} {error.problem}")
    return error.as_option()


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ...  # required


def _cli_type(hint):
    """The type typer parses an option of config type `hint` as: a Literal as str (the config checks
    the value and names the choices), a union with str as str (a path or a URL), X | None as Optional[X],
    tuple[X, ...] as list[X] (a repeatable option)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return type(args[0])
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[_cli_type(args[0])]
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        inner = str if str in present else _cli_type(present[0])
        return Optional[inner] if len(present) < len(args) else inner
    if hint is Path:
        return Path
    return hint

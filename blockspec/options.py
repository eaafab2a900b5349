"""Options declared once, as dataclass fields, and turned into command-line flags from there.

An option is a field made with `option(default, help, commands)`: its name gives the flag
(`max_num_seqs` → `--max-num-seqs`), its annotation the argparse type, its default the flag's
default (shown by `--help`), and `commands` which of serve / generate / bench take it. The same
dataclass is the LLM(...) keyword arguments and the server's settings, so adding an option is one
field in one place (EngineOptions in config.py, or ServerSettings in server/settings.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

SERVE, GENERATE, BENCH = "serve", "generate", "bench"
ALL_COMMANDS = frozenset({SERVE, GENERATE, BENCH})
T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """What a field needs to become a flag, beyond its name, type and default."""
    help: str
    commands: frozenset[str]
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def option(default: Any, help: str, commands: Iterable[str] = ALL_COMMANDS,
           choices: tuple[str, ...] | None = None, metavar: str | None = None) -> Any:
    """A dataclass field that is also a flag of `commands` (none: a keyword argument of LLM only)."""
    return dataclasses.field(default=default, metadata={"option": Option(help, frozenset(commands), choices, metavar)})


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except where there is none to show (None, a bare switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or isinstance(action, argparse._HelpAction):
            return action.help
        return super()._get_help_string(action)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def options_of(cls: type) -> list[tuple[dataclasses.Field, Option, Any]]:
    """(field, its Option, its resolved annotation) for every option field of `cls`, in order."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata["option"], hints[f.name]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def scalar_type(annotation: Any) -> Any:
    """`int | None` → int; `bool` → bool; `str` → str."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if len(args) != 1:
            raise TypeError(f"an option's type must be one scalar or Optional of one, not {annotation}")
        return args[0]
    return annotation


def add_flags(parser: argparse.ArgumentParser, cls: type, command: str) -> None:
    """Add a flag to `parser` for each option of `cls` that `command` takes."""
    for f, opt, annotation in options_of(cls):
        if command not in opt.commands:
            continue
        kind = scalar_type(annotation)
        kwargs: dict[str, Any] = {"default": f.default, "help": opt.help, "dest": f.name}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            converter: Callable[[str], Any] = kind
            kwargs["type"] = converter
            if opt.choices is not None:
                kwargs["choices"] = opt.choices
            metavar = opt.metavar or {int: "N", float: "SECONDS" if "seconds" in opt.help else "X"}.get(kind)
            if metavar is not None and opt.choices is None:
                kwargs["metavar"] = metavar
        parser.add_argument(flag_name(f.name), **kwargs)


def from_namespace(cls: type[T], args: argparse.Namespace, command: str, **overrides: Any) -> T:
    """An instance of `cls` from the flags `command` was given (other fields keep their default)."""
    values = {f.name: getattr(args, f.name) for f, opt, _ in options_of(cls)
              if command in opt.commands and hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def project(value: Any, cls: type[T], **overrides: Any) -> T:
    """The `cls` fields of a dataclass instance (e.g. the engine options inside the server's settings)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{name: getattr(value, name) for name in names}, **overrides})

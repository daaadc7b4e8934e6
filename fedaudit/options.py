"""What a configuration field says about itself on the command line: its option's name, help text, shown default and
group in ``fedaudit train --help``, kept in the field's metadata beside its default (one place per setting).

A section's dataclass declares a field with :func:`setting` (``rounds: int = setting(10, "Communication rounds
M.")``); the command line builds ``train``'s options from the fields (fedaudit/cli.py), and
:func:`fedaudit.config.option_field` maps an option back to its field. A default that the configuration resolves at
run time (by dataset, algorithm or DP) is left at None in the field and described in words by ``shown``;
tests/cli/test_help_defaults.py checks those words against what the configuration resolves.

Torch-free, and free of click: the configuration is read without either.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any

GROUPS = (
    "Run",
    "Data",
    "Model",
    "Federation",
    "Privacy",
    "Audit",
    "Evaluation",
    "Engine",
)  # the order of --help's sections; an algorithm's own section (its settings module's TITLE) follows them


@dataclass(frozen=True)
class Option:
    """A field's command-line option: ``help`` (without its default), ``shown`` (the default in words, when it is not
    the field's literal default), ``when`` (the condition the shown default holds under, e.g. "with --dp"),
    ``name`` (the option's name, when it is not the field's), ``choices``, whether the value names a file or a
    directory (``path``), whether a flag has a ``--no-`` form (``negatable``), whether it is given once per value
    (``multiple``) and its ``group`` in --help (by default its section's)."""

    help: str
    shown: str | None = None
    when: str | None = None
    name: str | None = None
    choices: tuple[str, ...] | None = None
    path: str | None = None  # "file" or "dir": the value names one
    negatable: bool = True
    multiple: bool = False
    group: str | None = None
    metavar: str | None = None


def setting(default: Any = MISSING, help: str = "", **option: Any) -> Any:
    """A dataclass field with ``default`` whose metadata holds its command-line :class:`Option`."""
    return dataclasses.field(default=default, metadata={"option": Option(help=help, **option)})


def option_of(field: dataclasses.Field) -> Option | None:
    """The field's :class:`Option`, or None for a field that has no option (set by fedaudit itself)."""
    return field.metadata.get("option")


def option_name(field: dataclasses.Field) -> str:
    """The option's name as click names its parameter (``client_lr``'s is ``lr``)."""
    option = option_of(field)
    return (option.name if option and option.name else field.name).replace("-", "_")


def shown_default(field: dataclasses.Field) -> str | None:
    """The default ``--help`` shows: the option's words, else the field's literal default (on/off for a flag,
    numbers as %g, a tuple's values joined by commas), else nothing (None and empty defaults are resolved or mean
    "not given")."""
    option = option_of(field)
    if option is not None and option.shown is not None:
        return option.shown
    default = field.default
    if default is MISSING or default is None or default == ():
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    return ", ".join(_shown_value(value) for value in (default if isinstance(default, tuple) else (default,)))


def _shown_value(value: Any) -> str:
    """One default value as --help shows it: numbers as %g."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def help_text(field: dataclasses.Field) -> str:
    """The option's help text with its default: "Communication rounds M. [default: 10]"."""
    option = option_of(field)
    assert option is not None, f"{field.name} has no command-line option"
    shown = shown_default(field)
    if shown is None:
        return option.help
    when = f" {option.when}" if option.when else ""
    return f"{option.help} [default{when}: {shown}]"

"""One base for every error a user can cause: the command line turns it into one sentence and its exit code.

Each package names its own errors (``ConfigError``, ``RunError``, ``AttackError``, ...) on this base, so a new
error class is a user error by construction, and ``fedaudit`` catches exactly one type. Anything else that escapes
a command is a bug and keeps its traceback.
"""

from __future__ import annotations

import math

USER_ERROR_EXIT = 2  # click's own code for usage errors; a report's policy verdicts use 0, 1 and 3


class UserError(ValueError):
    """Something the user can fix (a bad option, a missing file, an out-of-range value), said in one sentence.

    It stays a :class:`ValueError`, so library callers that catch that keep working.
    """

    exit_code: int = USER_ERROR_EXIT


class ConfigError(UserError):
    """An invalid configuration value (one clear sentence for the user)."""


def require(condition: bool, message: str) -> None:
    """A :class:`ConfigError` saying ``message`` unless ``condition`` holds: one line per rule of a configuration."""
    if not condition:
        raise ConfigError(message)


def is_int(value: object) -> bool:
    """An integer, and not a bool (which JSON and YAML readers would let through as 0 or 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flag(field: str) -> str:
    """The command-line option named after a configuration field (``dm_ipc`` -> ``--dm-ipc``)."""
    return "--" + field.replace("_", "-")


def require_positive_integers(section: object, *fields: str, optional: bool = False) -> None:
    """A :class:`ConfigError` unless each named field of ``section`` is an integer >= 1 (or None, if ``optional``)."""
    for field in fields:
        value = getattr(section, field)
        require(
            (optional and value is None) or (is_int(value) and value >= 1),
            f"{_flag(field)} must be a positive integer, got {value!r}.",
        )


def require_positive_numbers(section: object, *fields: str, optional: bool = False) -> None:
    """A :class:`ConfigError` unless each named field of ``section`` is finite and > 0 (or None, if ``optional``)."""
    for field in fields:
        value = getattr(section, field)
        require(
            (optional and value is None) or (is_number(value) and value > 0),
            f"{_flag(field)} must be positive, got {value!r}.",
        )

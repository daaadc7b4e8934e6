"""One base for every error a user can cause: the command line turns it into one sentence and its exit code.

Each package names its own errors (``ConfigError``, ``RunError``, ``AttackError``, ...) on this base, so a new
error class is a user error by construction, and ``fedaudit`` catches exactly one type. Anything else that escapes
a command is a bug and keeps its traceback.
"""

from __future__ import annotations

USER_ERROR_EXIT = 2  # click's own code for usage errors; a report's policy verdicts use 0, 1 and 3


class UserError(ValueError):
    """Something the user can fix (a bad option, a missing file, an out-of-range value), said in one sentence.

    It stays a :class:`ValueError`, so library callers that catch that keep working.
    """

    exit_code: int = USER_ERROR_EXIT

"""fedaudit: train federated models (FedLAP-DP and DP gradient-sharing baselines) and audit their privacy.

The commands are functions here too: ``fedaudit.train``, ``resume``, ``attack``, ``verify``, ``report``, ``compare``
and ``run_config`` (:mod:`fedaudit.api`, imported when one is first used, so that ``import fedaudit`` stays quick).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

COMMANDS = ("train", "resume", "attack", "verify", "report", "compare", "run_config")


def __getattr__(name: str) -> Any:
    if name in COMMANDS:
        from fedaudit import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedaudit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *COMMANDS])

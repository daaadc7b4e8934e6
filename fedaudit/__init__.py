"""fedaudit: train federated models (FedLAP-DP and DP gradient-sharing baselines) and audit their privacy.

The commands are functions here too: ``fedaudit.train``, ``resume``, ``attack``, ``verify``, ``report``, ``compare``
and ``run_config`` (:mod:`fedaudit.api`, imported when one is first used, so that ``import fedaudit`` stays quick).
"""

from __future__ import annotations

import os
import sys
from typing import Any

if "torch" not in sys.modules:
    # torch's CPU allocator then backs tensors of 2 MB and more with transparent huge pages where the kernel allows
    # them: a DP step's large activations stop costing a page fault per 4 kB (a thousand-client federation at width
    # 128 trained in 0.78 of the time, docs/performance.md). THP_MEM_ALLOC_ENABLE=0 in the environment keeps the
    # default; torch reads it once, at its first allocation.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

COMMANDS = ("train", "resume", "attack", "verify", "report", "compare", "run_config")


def __getattr__(name: str) -> Any:
    if name in COMMANDS:
        from fedaudit import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedaudit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *COMMANDS])

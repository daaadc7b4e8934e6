"""Engines that run the clients of a round: in-process (local) or on Flower's simulation runtime (flower)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fedaudit.engine.base import Engine
from fedaudit.engine.local import LocalEngine

if TYPE_CHECKING:
    from fedaudit.config import RunConfig

__all__ = ["Engine", "LocalEngine", "make_engine"]


def make_engine(
    config: RunConfig, *, num_clients: int, progress: bool, echo: Callable[[str], None] | None = None
) -> Engine:
    """The engine ``config.engine`` names, as a context manager that releases what it started."""
    if config.engine == "flower":
        from fedaudit.engine.flower import FlowerEngine

        return FlowerEngine(config, num_clients=num_clients)  # replies come back together: no per-client bar
    return LocalEngine(progress=progress, echo=echo, parallel=config.parallel_clients)

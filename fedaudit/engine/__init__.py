"""Engines that run the clients of a round: in-process (local), or on Flower (its simulation runtime, or a deployment's
SuperNodes with --superlink)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from fedaudit.engine.base import Engine
from fedaudit.engine.local import LocalEngine

if TYPE_CHECKING:
    import numpy as np

    from fedaudit.config import RunConfig
    from fedaudit.data.sites import SiteReport

__all__ = ["Engine", "LocalEngine", "make_engine"]


def make_engine(
    config: RunConfig,
    *,
    num_clients: int,
    progress: bool,
    echo: Callable[[str], None] | None = None,
    membership: Sequence[np.ndarray] = (),
    sites: Sequence[SiteReport] = (),
) -> Engine:
    """The engine ``config.engine`` names, as a context manager that releases what it started.

    ``membership`` is each client's record indices: a Flower deployment checks that every site holds its client's;
    ``sites`` are the reports of a deployment's sites that keep their records (each must still hold what it reported).
    """
    if config.engine == "flower" and config.flower.superlink is not None:
        from fedaudit.engine.deployment import DeploymentEngine

        return DeploymentEngine(config, num_clients=num_clients, membership=membership, sites=sites)
    if config.engine == "flower":
        from fedaudit.engine.simulation import FlowerEngine

        return FlowerEngine(config, num_clients=num_clients)  # replies come back together: no per-client bar
    return LocalEngine(progress=progress, echo=echo, parallel=config.parallel_clients)

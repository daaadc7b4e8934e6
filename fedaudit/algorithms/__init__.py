"""Federated algorithms, one family per module, looked up by the configured name."""

from __future__ import annotations

from fedaudit.algorithms.base import Algorithm
from fedaudit.config import RunConfig


def get_algorithm(config: RunConfig) -> Algorithm:
    """The algorithm object for ``config.federated.algorithm``."""
    from fedaudit.algorithms.fedavg import FedAvg
    from fedaudit.algorithms.fedlap import FedLAP

    name = config.federated.algorithm
    if name == "fedavg":
        return FedAvg(name)
    if name == "fedprox":
        return FedAvg(name, mu=config.federated.mu)
    if name == "fedsgd":
        return FedAvg(name, single_step=True)
    if name == "fedlap":
        return FedLAP()
    raise ValueError(f"Algorithm '{name}' is not available in this version of fedaudit.")

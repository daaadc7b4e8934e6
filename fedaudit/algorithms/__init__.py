"""Federated algorithms, one family per module; :mod:`fedaudit.registry` names them and builds them."""

from __future__ import annotations

from fedaudit.algorithms.base import Algorithm
from fedaudit.config import ConfigError, RunConfig
from fedaudit.registry import ALGORITHMS


def get_algorithm(config: RunConfig) -> Algorithm:
    """The algorithm object for ``config.federated.algorithm``, built from its registry entry."""
    entry = ALGORITHMS.get(config.federated.algorithm)
    if entry is None:
        raise ConfigError(f"Unknown algorithm '{config.federated.algorithm}'; choose one of: {', '.join(ALGORITHMS)}.")
    return entry.build(config)

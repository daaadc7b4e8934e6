"""Fedssyn's configuration section (``fedssyn``) and its validation, read by the configuration without importing
torch (the algorithm: fedaudit.algorithms.fedssyn)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fedaudit.errors import is_number, require, require_positive_integers, require_positive_numbers
from fedaudit.options import setting
from fedaudit.registry import ALGORITHMS

SECTION = "fedssyn"
TITLE = "Fedssyn"  # its options' group in fedaudit train --help
FEDSSYN_INNER = ALGORITHMS[SECTION].inner_algorithms


@dataclass(frozen=True)
class FedssynConfig:
    """Fedssyn: in its first round every client trains a class-conditional generator on a fraction of its records
    and sends generated records; the server shuffles them and deals every client an equal share, which the client
    then trains on with its own records under the inner algorithm, every later round (docs/algorithms.md)."""

    inner_algorithm: str = setting(
        "fedavg",
        "Fedssyn: the federated algorithm that trains on real plus shuffled synthetic records after the generation"
        " round.",
        choices=FEDSSYN_INNER,
    )
    generator_fraction: float = setting(0.75, "Fedssyn rho: the share of a client's records its generator trains on.")
    synthetic_per_client: int | None = setting(
        None,
        "Fedssyn n~: records each client generates, and the size of every client's shuffled share.",
        shown="the mean client's records",
    )
    generator_epochs: int = setting(30, "Fedssyn: epochs of the generator's training.")
    generator_batch: int = setting(64, "Fedssyn: generator minibatch (expected batch under DP).")
    generator_lr: float = setting(1e-3, "Fedssyn: generator learning rate (Adam).")
    generator_clip: float = setting(1.0, "Fedssyn with --dp: clipping norm of the generator's DP-SGD.")


Section = FedssynConfig


def validate(fs: FedssynConfig, config: Any, *, selected: bool) -> None:
    """Fedssyn's section; its options with another algorithm; what Fedssyn needs of the run."""
    require(
        fs.inner_algorithm in FEDSSYN_INNER,
        f"--inner-algorithm must be one of {', '.join(FEDSSYN_INNER)}, got {fs.inner_algorithm!r}.",
    )
    require(
        is_number(fs.generator_fraction) and 0 < fs.generator_fraction <= 1,
        f"--generator-fraction must be in (0, 1], got {fs.generator_fraction!r}.",
    )
    require_positive_integers(fs, "synthetic_per_client", optional=True)
    require_positive_integers(fs, "generator_epochs", "generator_batch")
    require_positive_numbers(fs, "generator_lr", "generator_clip")
    if not selected:
        require(
            fs == FedssynConfig(),
            "The Fedssyn options (--inner-algorithm, --generator-*, --synthetic-per-client) need --algorithm fedssyn.",
        )
        return
    require(
        config.federated.rounds >= 2,
        "Fedssyn's first round makes and deals the synthetic records and the inner algorithm trains from the "
        "second on: give --rounds 2 or more.",
    )


def generator_records(config: Any, num_examples: int) -> int:
    """m = floor(rho N_k), at least one: the records a client's generator trains on (``config``: a RunConfig)."""
    return max(1, int(config.fedssyn.generator_fraction * num_examples))


def for_clients(fs: FedssynConfig, config: Any, sizes: Mapping[int, int]) -> FedssynConfig:
    """The section once the clients' sizes are known: n~ (the mean client's size unless given), and a generator
    batch that no client's draw is smaller than."""
    if fs.synthetic_per_client is None:
        fs = replace(fs, synthetic_per_client=max(1, sum(sizes.values()) // len(sizes)))
    smallest = min(generator_records(replace(config, fedssyn=fs), n) for n in sizes.values())
    require(
        fs.generator_batch <= smallest,
        f"--generator-batch {fs.generator_batch} exceeds the {smallest} records the smallest client's generator "
        f"trains on (--generator-fraction {fs.generator_fraction:g} of its records); use at most {smallest}.",
    )
    return fs


def dp_note(fs: FedssynConfig) -> tuple[str, str]:
    """What a DP run's epsilon covers, and how to compare it, for the report's notes."""
    return (
        "Fedssyn with DP: the epsilon covers both phases on the same records (their costs add): the generation "
        "round (the class counts, one Gaussian query, and the generator's DP-SGD) and the inner algorithm's "
        f"DP-SGD ({fs.inner_algorithm}) on the client's records plus its shuffled share, sampled together; the "
        "per-client events are in privacy.json.",
        "compare it with other runs by epsilon, not by the noise multiplier",
    )

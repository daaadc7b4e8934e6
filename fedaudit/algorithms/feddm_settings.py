"""FedDM's configuration section (``feddm``) and its validation, read by the configuration without importing torch
(the algorithm: fedaudit.algorithms.feddm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedaudit.errors import require, require_positive_integers, require_positive_numbers
from fedaudit.options import setting

SECTION = "feddm"
TITLE = "FedDM"  # its options' group in fedaudit train --help


@dataclass(frozen=True)
class FedDMConfig:
    """FedDM: each round, synthetic sets matched to the real data's mean embeddings and mean logits on networks
    sampled around the global model; the server trains inside a ball of that radius (docs/algorithms.md)."""

    dm_ipc: int = setting(10, "FedDM: synthetic images per class a client holds.")
    dm_iterations: int = setting(100, "FedDM: image steps, each on a newly sampled network.")
    dm_lr: float = setting(1.0, "FedDM: synthetic image learning rate (SGD, momentum 0.5).")
    dm_batch: int = setting(256, "FedDM: real images per class in one step.")
    dm_radius: float = setting(
        5.0, "FedDM rho: networks are sampled at this distance from the global model, and the server trains within it."
    )


Section = FedDMConfig


def validate(dm: FedDMConfig, config: Any, *, selected: bool) -> None:
    """FedDM's section; its options with another algorithm; FedDM has no DP variant here."""
    require_positive_integers(dm, "dm_ipc", "dm_iterations", "dm_batch")
    require_positive_numbers(dm, "dm_lr", "dm_radius")
    if not selected:
        require(dm == FedDMConfig(), "The FedDM options (--dm-*) need --algorithm feddm.")
        return
    require(
        not config.privacy.dp,
        "FedDM runs without DP here: its paper's DP variant protects class-wise statistics and is not specified "
        "precisely enough to account; use --algorithm fedlap --dp for DP synthetic sets.",
    )

"""FedGM's configuration section (``fedgm``: the distillation and the label DP of what it sends) and its validation,
read by the configuration without importing torch (the algorithm: fedaudit.algorithms.fedgm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedaudit.errors import is_int, require, require_positive_integers, require_positive_numbers

SECTION = "fedgm"
LABEL_MECHANISMS = ("rr", "rr-top-k", "rr-with-prior")
DISTILL_INITS = ("real", "noise")


@dataclass(frozen=True)
class FedGMConfig:
    """FedGM: one-shot distillation by class-wise gradient matching, the labels sent under label DP
    (docs/algorithms.md). The run's rounds are FedGM's stages T: each client releases 1/T of its synthetic set per
    round, its labels randomized with a prior from the server's model of the stages before."""

    distill_ipc: int = 10  # synthetic images per class a client holds
    distill_iterations: int = 20  # fresh random networks the matching runs on (outer loop)
    distill_steps: int = 10  # matching steps per network (inner loop), each followed by one network step
    distill_lr: float = 0.1  # SGD (momentum 0.5) on the synthetic images
    distill_batch: int = 128  # real images per class in one matching step
    distill_init: str = "real"  # real: start from randomly drawn real images of the class (the paper); noise
    label_epsilon: float | None = None  # label DP of every label sent; None: labels are sent in clear
    label_mechanism: str = "rr-with-prior"
    top_k: int | None = None  # k of rr-top-k
    server_steps: int = 500  # SGD steps of the server on the union of what it received


Section = FedGMConfig


def _check_values(gm: FedGMConfig) -> None:
    """The section's own values, whichever algorithm runs."""
    require_positive_integers(gm, "distill_ipc", "distill_iterations", "distill_steps", "distill_batch", "server_steps")
    require_positive_numbers(gm, "distill_lr")
    require(
        gm.distill_init in DISTILL_INITS,
        f"--distill-init must be one of {', '.join(DISTILL_INITS)}, got {gm.distill_init!r}.",
    )
    require_positive_numbers(gm, "label_epsilon", optional=True)
    require(
        gm.label_mechanism in LABEL_MECHANISMS,
        f"--label-mechanism must be one of {', '.join(LABEL_MECHANISMS)}, got {gm.label_mechanism!r}.",
    )
    require(
        (gm.top_k is None) == (gm.label_mechanism != "rr-top-k"),
        "--top-k is needed by --label-mechanism rr-top-k, and by no other mechanism.",
    )
    require(gm.top_k is None or (is_int(gm.top_k) and gm.top_k >= 1), f"--top-k must be at least 1, got {gm.top_k!r}.")


def validate(gm: FedGMConfig, config: Any, *, selected: bool) -> None:
    """FedGM's section, and what FedGM cannot do; its options with another algorithm."""
    _check_values(gm)
    if not selected:
        require(
            gm == FedGMConfig(),
            "The FedGM options (--label-epsilon, --label-mechanism, --top-k, --distill-*, --server-steps) need "
            "--algorithm fedgm.",
        )
        return
    require(
        not config.privacy.dp,
        "FedGM protects the labels it sends (label DP, --label-epsilon), not the records: --dp (record-level "
        "DP-SGD) does not apply to it.",
    )
    require(
        config.federated.client_fraction == 1.0,
        "FedGM releases every client's synthetic set in stages, one per round, so every client must take part "
        "in every round (--client-fraction 1).",
    )

"""FedGM's configuration section (``fedgm``: the distillation and the label DP of what it sends) and its validation,
read by the configuration without importing torch (the algorithm: fedaudit.algorithms.fedgm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedaudit.errors import is_int, require, require_positive_integers, require_positive_numbers
from fedaudit.options import setting

SECTION = "fedgm"
TITLE = "FedGM"  # its options' group in fedaudit train --help
LABEL_MECHANISMS = ("rr", "rr-top-k", "rr-with-prior")
DISTILL_INITS = ("real", "noise")


@dataclass(frozen=True)
class FedGMConfig:
    """FedGM: one-shot distillation by class-wise gradient matching, the labels sent under label DP
    (docs/algorithms.md). The run's rounds are FedGM's stages T: each client releases 1/T of its synthetic set per
    round, its labels randomized with a prior from the server's model of the stages before."""

    distill_ipc: int = setting(10, "FedGM: synthetic images per class a client holds.")
    distill_iterations: int = setting(
        20, "FedGM: freshly initialised networks the gradient matching runs on (its outer loop)."
    )
    distill_steps: int = setting(
        10, "FedGM: matching steps per network (its inner loop), each followed by one network step."
    )
    distill_lr: float = setting(0.1, "FedGM: synthetic image learning rate (SGD, momentum 0.5).")
    distill_batch: int = setting(128, "FedGM: real images per class in a matching step.")
    distill_init: str = setting(
        "real",
        "FedGM: start the synthetic images from real images of the class (the paper's) or from noise.",
        choices=DISTILL_INITS,
    )
    label_epsilon: float | None = setting(
        None,
        "FedGM: label DP of every label sent (epsilon of the label mechanism; images are sent in clear).",
        shown="none, labels in clear",
    )
    label_mechanism: str = setting(
        "rr-with-prior",
        "FedGM: randomized response, RR over the prior's top k, or RR with the best k for the prior (the server's "
        "model of the earlier stages).",
        choices=LABEL_MECHANISMS,
    )
    top_k: int | None = setting(None, "FedGM: k of --label-mechanism rr-top-k.")
    server_steps: int = setting(500, "FedGM: server SGD steps on the union of what it received.")


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

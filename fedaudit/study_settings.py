"""A study's own settings (``fedaudit compare``): the algorithms, privacy budgets and seeds it compares, equal data
access, and its report's formats and policy, each declared with its command-line option (fedaudit.options).

Torch-free, like the configuration's sections, so that the command line builds compare's options and shows their
defaults without loading the study's machinery (fedaudit/study.py, whose ``Study`` adds the base configuration of
the runs and the attack's options to these).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from fedaudit.config import RunConfig
from fedaudit.errors import UserError
from fedaudit.options import setting
from fedaudit.registry import ALGORITHMS

DEFAULT_ALGORITHMS: tuple[str, ...] = ("fedavg", "fedprox", "fedlap")


class StudyError(UserError):
    """A study that cannot be run as given (one clear sentence)."""


@dataclass(frozen=True)
class Budget:
    """One privacy level of a study: a target epsilon (sigma calibrated per run), a fixed sigma, or no DP; record-level
    (DP-SGD on the clients) unless ``level`` is "client" (updates clipped and noised at the server)."""

    kind: str  # "epsilon", "sigma" or "none"
    value: float | None = None
    level: str = "record"

    @classmethod
    def parse(cls, text: Any) -> Budget:
        """``epsilon:E``, ``sigma:S`` or ``none``, the first two with ``client:`` before them for client-level DP (the
        syntax of ``--budget`` and of a study file's budgets list)."""
        spec = str(text).strip().lower()
        if spec in ("none", "no-dp", "nodp"):
            return cls("none")
        level = "record"
        if spec.startswith("client:"):
            level, spec = "client", spec.removeprefix("client:")
        kind, _, number = spec.partition(":")
        kind = {"eps": "epsilon", "epsilon": "epsilon", "sigma": "sigma", "noise": "sigma"}.get(kind, "")
        try:
            value = float(number) if "_" not in number else math.nan  # float reads 1_0 as 10: a typo, not a number
        except ValueError:
            value = math.nan
        if not kind or not math.isfinite(value) or value <= 0:
            raise StudyError(
                f"Budget {text!r} is not understood; use epsilon:E or sigma:S with a positive number (client:epsilon:E "
                "or client:sigma:S for client-level DP), or none."
            )
        return cls(kind, value, level)

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        return f"{'client:' if self.client_level else ''}{self.kind}:{self.value:g}"

    @property
    def client_level(self) -> bool:
        return self.level == "client"

    @property
    def slug(self) -> str:
        """The budget's part of a run name: eps8, sigma1, nodp; client-eps8 at client level."""
        if self.kind == "none":
            return "nodp"
        unit = "client-" if self.client_level else ""
        return f"{unit}{'eps' if self.kind == 'epsilon' else 'sigma'}{self.value:g}"

    def apply(self, config: RunConfig, *, max_update_norm: float | None = None) -> RunConfig:
        """``config`` with this budget's privacy settings (without DP the clipping norm and the canaries, which audit
        a DP accountant, are dropped; at client level the clients' updates are clipped to ``max_update_norm`` and
        the record-level clipping norm and canaries are dropped)."""
        privacy = config.privacy
        if self.kind == "none" or self.client_level:  # record-level canaries audit a record-level DP run
            config = replace(config, audit=replace(config.audit, canaries=0))
        if not self.client_level:  # canary clients audit a client-level one
            config = replace(config, audit=replace(config.audit, canary_clients=0))
        if self.kind == "none":
            privacy = replace(privacy, dp=False, noise_multiplier=None, target_epsilon=None, max_grad_norm=None)
        elif self.kind == "epsilon":
            privacy = replace(privacy, dp=True, noise_multiplier=None, target_epsilon=self.value)
        else:
            privacy = replace(privacy, dp=True, noise_multiplier=self.value, target_epsilon=None)
        if self.client_level:
            privacy = replace(privacy, dp_level="client", max_update_norm=max_update_norm, max_grad_norm=None)
        config = replace(config, privacy=replace(privacy, calibrated=False))
        if not config.dp_randomness:  # how DP noise is drawn means nothing to a run that draws none
            config = replace(config, privacy=replace(config.privacy, noise_seed=None, secure_noise=False))
        return config


@dataclass(frozen=True)
class StudySettings:
    """What a study compares, and the formats and policy of its report."""

    algorithms: tuple[str, ...] = setting(
        DEFAULT_ALGORITHMS, "Repeat for several.", name="algorithm", choices=tuple(ALGORITHMS), multiple=True
    )
    budgets: tuple[Budget, ...] = setting(
        (Budget("sigma", 1.0),),
        "epsilon:E (sigma calibrated so that epsilon after the last round is at most E; eps:E is the same), sigma:S "
        "(noise:S is the same), or none (no DP; also no-dp); client:epsilon:E or client:sigma:S for client-level DP "
        "(with --max-update-norm); repeat for several.",
        name="budget",
        multiple=True,
        metavar="SPEC",
    )
    seeds: tuple[int, ...] = setting(
        (0,), "Repeat for several; the report gives mean and spread over seeds.", name="seed", multiple=True
    )
    equal_data_access: bool = setting(
        False,
        "FedAvg/FedProx make as many DP queries per round as FedLAP's worst case (the paper's fair comparison).",
    )
    formats: tuple[str, ...] = setting(
        ("html",), "html, md or pdf; repeat for several.", name="format", multiple=True, metavar="FORMAT"
    )
    max_update_norm: float | None = setting(
        None,
        "C of the client-level budgets (client:epsilon:E, client:sigma:S): each client's update is clipped to this "
        "L2 norm; needed when a budget is client level.",
    )
    policy: str | None = setting(
        None,
        "YAML limits checked on every run, as for report --policy; exit code 1 when a run fails one, 3 when one is "
        "INCONCLUSIVE.",
        path="file",
    )

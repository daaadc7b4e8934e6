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
    """One privacy level of a study: a target epsilon (sigma calibrated per run), a fixed sigma, or no DP."""

    kind: str  # "epsilon", "sigma" or "none"
    value: float | None = None

    @classmethod
    def parse(cls, text: Any) -> Budget:
        """``epsilon:E``, ``sigma:S`` or ``none`` (the syntax of ``--budget`` and of a study file's budgets list)."""
        spec = str(text).strip().lower()
        if spec in ("none", "no-dp", "nodp"):
            return cls("none")
        kind, _, number = spec.partition(":")
        kind = {"eps": "epsilon", "epsilon": "epsilon", "sigma": "sigma", "noise": "sigma"}.get(kind, "")
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if not kind or not math.isfinite(value) or value <= 0:
            raise StudyError(
                f"Budget {text!r} is not understood; use epsilon:E or sigma:S with a positive number, or none."
            )
        return cls(kind, value)

    def __str__(self) -> str:
        return "none" if self.kind == "none" else f"{self.kind}:{self.value:g}"

    @property
    def slug(self) -> str:
        """The budget's part of a run name: eps8, sigma1, nodp."""
        if self.kind == "none":
            return "nodp"
        return f"{'eps' if self.kind == 'epsilon' else 'sigma'}{self.value:g}"

    def apply(self, config: RunConfig) -> RunConfig:
        """``config`` with this budget's privacy settings (without DP the clipping norm and the canaries, which audit
        a DP accountant, are dropped)."""
        privacy = config.privacy
        if self.kind == "none":
            config = replace(config, audit=replace(config.audit, canaries=0))
        if self.kind == "none":
            privacy = replace(privacy, dp=False, noise_multiplier=None, target_epsilon=None, max_grad_norm=None)
        elif self.kind == "epsilon":
            privacy = replace(privacy, dp=True, noise_multiplier=None, target_epsilon=self.value)
        else:
            privacy = replace(privacy, dp=True, noise_multiplier=self.value, target_epsilon=None)
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
        "(noise:S is the same), or none (no DP; also no-dp); repeat for several.",
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
    policy: str | None = setting(
        None,
        "YAML limits checked on every run, as for report --policy; exit code 1 when a run fails one, 3 when one is "
        "INCONCLUSIVE.",
        path="file",
    )

"""Compliance policies: limits read from YAML, checked against each run's summary."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from reports.collect import ReportError, RunSummary

LIMITS: dict[str, str] = {
    "max_epsilon": "accountant's epsilon after the last round <= {limit:g} at delta {delta}",
    "max_attack_auc": "upper 95% bound of the AUC of every attack on the final model <= {limit:g}",
    "max_tpr_at_0_1pct_fpr": "TPR at 0.1% FPR of every attack on the final model <= {limit:g}",
    "min_accuracy": "final test accuracy >= {limit:g}",
}
OPTIONS = ("delta",)


@dataclass(frozen=True)
class Policy:
    """Limits a run must meet; None means the limit is not set."""

    max_epsilon: float | None = None
    delta: float | None = None
    max_attack_auc: float | None = None
    max_tpr_at_0_1pct_fpr: float | None = None
    min_accuracy: float | None = None
    source: str = ""

    def limits(self) -> dict[str, float]:
        """The limits that are set, by name."""
        return {name: getattr(self, name) for name in LIMITS if getattr(self, name) is not None}


@dataclass(frozen=True)
class Check:
    """One limit checked on one run."""

    run: str
    limit: str
    requirement: str
    value: float | None
    passed: bool
    detail: str

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"


def read_yaml(file: Path, what: str, error: type[ReportError] = ReportError) -> Any:
    """The content of a YAML file (yaml.safe_load); unreadable or malformed is one sentence naming ``what`` it is."""
    try:
        return yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"Cannot read the {what} {file}: {getattr(exc, 'strerror', None) or exc}.") from exc
    except yaml.YAMLError as exc:
        raise error(f"The {what} {file} is not valid YAML.") from exc


def load_policy(path: str | Path) -> Policy:
    """Read a YAML policy; unknown keys and non-numeric limits are a :class:`ReportError`."""
    file = Path(path)
    data = read_yaml(file, "policy file")
    if not isinstance(data, dict) or not data:
        raise ReportError(f"The policy file {file} must be a YAML mapping of limits such as max_epsilon: 8.")
    known = (*LIMITS, *OPTIONS)
    values: dict[str, float] = {}
    for key, value in data.items():
        if key not in known:
            raise ReportError(f"Unknown limit {key!r} in the policy file {file}; use {', '.join(known)}.")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ReportError(f"The limit {key} in the policy file {file} must be a number, got {value!r}.") from None
        if math.isnan(number):
            raise ReportError(f"The limit {key} in the policy file {file} must be a number, got {value!r}.")
        values[key] = number
    if not any(key in LIMITS for key in values):
        raise ReportError(f"The policy file {file} sets no limit; use {', '.join(LIMITS)}.")
    return Policy(**values, source=str(file))


def check_run(policy: Policy, run: RunSummary) -> list[Check]:
    """Check every limit of ``policy`` on ``run``; a value that is not available fails its limit."""
    checks = []
    for name, limit in policy.limits().items():
        requirement = LIMITS[name].format(limit=limit, delta="of the run" if policy.delta is None else f"{policy.delta:g}")
        value, passed, detail = _CHECKS[name](policy, run, limit)
        checks.append(Check(run.name, name, requirement, value, passed, detail))
    return checks


def _epsilon(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, bool, str]:
    privacy = run.privacy
    if not privacy.dp:
        return math.inf, False, "no DP guarantee: epsilon is infinite"
    if not privacy.epsilon_per_round:
        return None, False, "not available: the privacy ledger is missing"
    eps = privacy.epsilon
    if policy.delta is not None and privacy.delta is None:
        return eps, False, f"the run's delta is not recorded, so it cannot be compared with the policy's delta {policy.delta:g}"
    if policy.delta is not None and privacy.delta > policy.delta:
        return eps, False, f"accounted at delta {privacy.delta:g}, larger than the policy's delta {policy.delta:g}"
    delta = "not recorded" if privacy.delta is None else f"{privacy.delta:g}"
    return eps, eps <= limit, f"epsilon {eps:.4g} at delta {delta}"


def _auc(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, bool, str]:
    bounds = [(a.auc_ci[1], a.label) for a in run.final_attacks if a.auc_ci is not None]
    if not bounds:
        return None, False, "not available: no attack results with an AUC interval"
    value, label = max(bounds)
    return value, value <= limit, f"upper bound {value:.4f} ({label})"


def _tpr(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, bool, str]:
    values = [(a.tpr_at_0_1pct_fpr, a.label) for a in run.final_attacks if a.tpr_at_0_1pct_fpr is not None]
    if not values:
        return None, False, "not available: no attack results with TPR at 0.1% FPR"
    value, label = max(values)
    return value, value <= limit, f"{value:.4f} ({label})"


def _accuracy(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, bool, str]:
    accuracy = run.final_accuracy
    if accuracy is None:
        return None, False, "not available: metrics.csv has no test accuracy"
    return accuracy, accuracy >= limit, f"{accuracy:.4f}"


_CHECKS = {"max_epsilon": _epsilon, "max_attack_auc": _auc, "max_tpr_at_0_1pct_fpr": _tpr, "min_accuracy": _accuracy}

"""What an attack wrote (attacks/NAME/metrics.json), read back with every field checked: rates with their intervals,
bound tests, canary audits and risk figures, None wherever a field is missing or malformed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedaudit.rundir.files import RunError


def _number(value: Any) -> float | None:
    """A JSON number as a float; None for null, NaN, or anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)


def _interval(value: Any) -> tuple[float, float] | None:
    """A JSON interval [low, high]; None when absent or not two numbers."""
    if isinstance(value, list) and len(value) == 2:
        low, high = _number(value[0]), _number(value[1])
        if low is not None and high is not None:
            return low, high
    return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class RateRecord:
    """One entry of an attack's "tpr_at_fpr": the TPR at a target FPR with its interval and sample sizes.

    Results of attack format 1 stored a bare number; ``detailed`` is False for those.
    """

    tpr: float | None
    detailed: bool = True
    ci95: tuple[float, float] | None = None
    estimable: bool = True
    num_members: int | None = None
    num_nonmembers: int | None = None
    nonmembers_needed: int | None = None
    fpr: float | None = None
    fpr_ci95: tuple[float, float] | None = None
    reason: str | None = None  # why it is not estimable

    @classmethod
    def from_json(cls, value: Any) -> RateRecord | None:
        if isinstance(value, dict):
            needed = value.get("nonmembers_needed")
            if needed is not None and _count(needed) is None:
                raise RunError(f"nonmembers_needed must be an integer, got {needed!r}.")
            return cls(
                tpr=_number(value.get("tpr")),
                ci95=_interval(value.get("ci95")),
                estimable=bool(value.get("estimable", True)),
                num_members=_count(value.get("num_members")),
                num_nonmembers=_count(value.get("num_nonmembers")),
                nonmembers_needed=needed,
                fpr=_number(value.get("fpr")),
                fpr_ci95=_interval(value.get("fpr_ci95")),
                reason=value.get("reason") if isinstance(value.get("reason"), str) else None,
            )
        number = _number(value)
        return None if number is None else cls(tpr=number, detailed=False)


BOUND_TEST_KEYS = (
    "threshold",
    "inequality",
    "true_positives",
    "false_positives",
    "bound_members",
    "bound_nonmembers",
    "delta",
)


def _bound_test(value: Any) -> dict[str, Any] | None:
    """The recorded test of an epsilon lower bound, or None when absent or incomplete (format 1 had none)."""
    if not isinstance(value, dict) or not set(BOUND_TEST_KEYS) <= set(value):
        return None
    if value["threshold"] is not None and value["inequality"] not in ("tpr", "tnr"):
        return None
    counts = [value[key] for key in ("true_positives", "false_positives", "bound_members", "bound_nonmembers")]
    if any(_count(c) is None or c < 0 for c in counts) or _number(value["delta"]) is None:
        return None  # a test whose counts are not counts cannot be recomputed at another confidence
    return dict(value)


def _canary_audit(value: Any) -> dict[str, Any] | None:
    """An attack's "canary_audit" entry, or None when it is not one fedaudit writes in the parts a report shows:
    its counts, kind and threat model, its estimate with a two-number interval, each estimator's epsilon, and its
    bound by the number of guesses."""
    if not isinstance(value, dict):
        return None
    estimate = value.get("estimate")
    estimators = value.get("estimators")
    guesses = value.get("bound_by_guesses", [])
    well_formed = (
        _count(value.get("canaries")) is not None
        and isinstance(value.get("canary_kind"), (str, type(None)))
        and "canary_kind" in value
        and isinstance(value.get("threat_model"), str)
        and _number(value.get("per_estimator_confidence")) is not None
        and (value.get("informative_canaries") is None or _count(value.get("informative_canaries")) is not None)
        and (estimate is None or (isinstance(estimate, dict) and _interval(estimate.get("ci95")) is not None))
        and isinstance(estimators, dict)
        and all(
            isinstance(estimators.get(name), dict) and _number(estimators[name].get("epsilon")) is not None
            for name in ("one-run", "gdp")
        )
        and isinstance(guesses, list)
        and all(
            isinstance(point, dict)
            and _count(point.get("guesses")) is not None
            and _number(point.get("epsilon")) is not None
            for point in guesses
        )
    )
    return dict(value) if well_formed else None


def _risk(value: Any) -> dict[str, Any] | None:
    """An attack's "risk" entry, or None when it is not one fedaudit writes: "most_exposed" a list of records,
    "tpr_at_fpr_per_client" rates by integer client id."""
    if not isinstance(value, dict):
        return None
    exposed = value.get("most_exposed", [])
    per_client = value.get("tpr_at_fpr_per_client", {})
    if not isinstance(exposed, list) or not all(isinstance(row, dict) for row in exposed):
        return None
    if not isinstance(per_client, dict) or not all(
        str(client).isdigit() and isinstance(entry, dict) for client, entry in per_client.items()
    ):
        return None
    return dict(value)


@dataclass(frozen=True)
class AttackRecord:
    """attacks/<name>/metrics.json, written by ``fedaudit attack`` (formats 1 and 2), read by reports and studies.

    Absent or malformed numbers read as None, so an older result still shows what it has; ``name`` is the result
    directory's name, ``<signal>-<method>[-round-N]``.
    """

    name: str
    signal: str
    method: str
    format_version: int | None
    round: int | None
    seed: int | None
    settings: Mapping[str, Any]  # nonmembers, max_records, bootstrap_resamples, per_layer: what a study compares
    auc: float | None
    auc_ci95: tuple[float, float] | None
    auc_se: float | None
    tpr_at_fpr: Mapping[str, RateRecord | None]  # "0.01", "0.001"
    balanced_accuracy: float | None
    advantage: float | None
    advantage_held_out: float | None
    advantage_held_out_ci95: tuple[float, float] | None
    epsilon_lower_bound: float | None
    epsilon_lower_bound_test: Mapping[str, Any] | None
    accountant_epsilon: float | None
    num_members: int | None
    num_nonmembers: int | None
    canary_audit: Mapping[str, Any] | None = None  # a canary audit's estimators (its bound needs no threshold test)
    direction: str | None = None  # "inverted" when the whole AUC interval is below 0.5
    risk: Mapping[str, Any] | None = None  # the most exposed records and TPR at low FPR per client and class
    references: Mapping[str, Any] | None = None  # rmia / lira: the reference models used
    unit: str = "record"  # what one member is: a record, or a client (attack --method client)

    SETTINGS = ("seed", "nonmembers", "max_records", "bootstrap_resamples", "per_layer")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str) -> AttackRecord:
        """The result in ``data`` (metrics.json), its directory called ``name``.

        Raises:
            RunError: a canary audit whose entry, or whose bound, is not what fedaudit writes (a report could not
                show it; an ordinary attack's malformed numbers read as None instead).
        """
        canary_audit = _canary_audit(data.get("canary_audit"))
        if "canary_audit" in data and (canary_audit is None or _number(data.get("epsilon_lower_bound")) is None):
            raise RunError(f"attacks/{name}/metrics.json holds a canary audit that is not one fedaudit writes.")
        signal, _, method = name.partition("-round-")[0].rpartition("-")
        rates = data.get("tpr_at_fpr") if isinstance(data.get("tpr_at_fpr"), dict) else {}
        held_out = data.get("advantage_held_out") if isinstance(data.get("advantage_held_out"), dict) else {}
        round_number = data.get("round")
        return cls(
            name=name,
            signal=str(data.get("signal", signal or name)),
            method=str(data.get("method", method)),
            format_version=_count(data.get("format_version")),
            round=int(round_number) if _number(round_number) is not None else None,
            seed=_count(data.get("seed")),
            settings={key: data.get(key) for key in cls.SETTINGS},
            auc=_number(data.get("auc")),
            auc_ci95=_interval(data.get("auc_ci95")),
            auc_se=_number(data.get("auc_se")),
            tpr_at_fpr={key: RateRecord.from_json(rates.get(key)) for key in ("0.01", "0.001")},
            balanced_accuracy=_number(data.get("balanced_accuracy")),
            advantage=_number(data.get("advantage")),
            advantage_held_out=_number(held_out.get("advantage")),
            advantage_held_out_ci95=_interval(held_out.get("ci95")),
            epsilon_lower_bound=_number(data.get("epsilon_lower_bound")),
            epsilon_lower_bound_test=_bound_test(data.get("epsilon_lower_bound_test")),
            accountant_epsilon=_number(data.get("accountant_epsilon")),
            num_members=_count(data.get("num_members")),
            num_nonmembers=_count(data.get("num_nonmembers")),
            canary_audit=canary_audit,
            direction=data["direction"]
            if data.get("direction") in ("inverted", "as expected", "undetermined")
            else None,
            risk=_risk(data.get("risk")),
            references=data["references"] if isinstance(data.get("references"), dict) else None,
            unit="client" if data.get("unit") == "client" else "record",
        )

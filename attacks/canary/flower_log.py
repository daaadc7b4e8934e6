"""The audit of a Flower app's canary log (``fedaudit attack --flower-log LOG``).

The log (``fedaudit.instruments.canary_log``, written by ``fedaudit.flower.CanaryClients``) holds, for m canary clients
of which about half were included, the cosine of every round's aggregate update and of the final model minus the initial
one with each canary's direction. Two views, each a score per canary (Andrew et al., ICLR 2024):

- ``all-iterates``: whoever sees every round's aggregate (the server, or anyone who sees every global model) scores
  canary i by the log-likelihood ratio of "sampled in each round with probability q" against "never there": each
  released round's cosines standardised over all canaries (median and MAD, which the inclusion bits do not enter),
  z_t,i, and sum_t log(1 - q + q exp(mu z_t,i - mu^2 / 2)) with mu = 1 / sigma, the shift a canary's clipped update
  makes in units of the noise on its direction (1 / (sigma sqrt(n)) under local DP, n the round's clients). With
  every client in every round this is mu times the sum of z (the cosines' evidence added up, where the largest
  cosine kept one round's); with q small it weighs the rounds where a canary stands out. Without DP noise (sigma 0),
  max_t cos(Delta_t, u_i);
- ``final-model``: whoever sees only the final model scores it by cos(theta_T - theta_0, u_i).

For each view: the two-Gaussian estimate of Andrew et al. (``gaussian_estimate``: a Gaussian fitted to the excluded
and the included canaries' scores with one variance, the epsilon of mu-GDP of their mean shift, a bootstrap
interval), and the split bounds (``split_audit``: the one-run bound of Steinke et al., valid for any mechanism, and the
Gaussian-DP bound, valid for a Gaussian one such as Flower's DP aggregation, each with its threshold chosen on one
half of the canaries and judged on the other). The four bounds are each
judged at confidence 1 - 0.05 / 4, so the largest holds at 95%. The unit of privacy is one client. The bounds are set
against the epsilon of the run's configuration by fedaudit's accountant (client-level DP: the Gaussian mechanism on
the aggregate, noise multiplier sigma, each released round a sample of n clients out of the population, canary
clients counted in both) and against what Flower itself reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedaudit.attacks import AttackError, Draw
from fedaudit.attacks.canary.estimators import bound_by_guesses, gaussian_estimate, split_audit
from fedaudit.attacks.metrics import CONFIDENCE, DEFAULT_RESAMPLES, Bootstrap, auc_score, bootstrap, roc
from fedaudit.instruments.canary_log import FORMAT, VERSION, CanaryLog, read_log
from fedaudit.privacy.accounting import SGMEvent, compute_epsilon
from fedaudit.rundir import atomic_write_bytes, csv_bytes, json_bytes
from fedaudit.seeding import Stream, derive_seed

ESTIMATORS = ("one-run", "gdp")
ACCOUNTANT = "rdp"
SPLIT_FRACTION = 0.5  # split_audit's default: half of the canaries choose the threshold, the other half judge it


@dataclass(frozen=True)
class FlowerView:
    name: str
    threat_model: str
    score: str


ALL_ITERATES = FlowerView(
    "all-iterates",
    "the server sees every round's aggregate update (all model iterates)",
    "sum over released rounds t of log(1 - q + q exp(mu z_t,i - mu^2 / 2)), z_t,i the round's cosine with u_i "
    "standardised over the canaries, mu = 1 / sigma (max_t cos(Delta_t, u_i) without noise)",
)
FINAL_MODEL = FlowerView("final-model", "only the final model is seen", "cos(theta_T - theta_0, u_i)")
VIEWS = (ALL_ITERATES, FINAL_MODEL)
LEVEL = 1.0 - (1.0 - CONFIDENCE) / (len(ESTIMATORS) * len(VIEWS))


@dataclass(frozen=True)
class FlowerAudit:
    """The audit of one log: metrics.json's content, the per-canary scores and each view's ROC."""

    metrics: dict[str, Any]
    scores: pd.DataFrame
    roc: pd.DataFrame


def view_scores(log: CanaryLog) -> dict[str, np.ndarray]:
    """Each view's score of every canary."""
    return {ALL_ITERATES.name: iterates_llr(log), FINAL_MODEL.name: log.final_cosines.copy()}


def iterates_llr(log: CanaryLog) -> np.ndarray:
    """The all-iterates score of every canary (module docstring): the log-likelihood ratio of a canary sampled
    with each round's probability against one never there, from the released rounds' standardised cosines."""
    kept = log.released == 1
    cosines = log.round_cosines[kept]
    sigma = float(log.noise_multiplier)
    if not cosines.size or not (math.isfinite(sigma) and sigma > 0):
        return cosines.max(axis=0) if cosines.size else np.zeros(log.canaries)
    centre = np.median(cosines, axis=1, keepdims=True)
    spread = 1.4826 * np.median(np.abs(cosines - centre), axis=1, keepdims=True)
    z = (cosines - centre) / np.where(spread > 0, spread, 1.0)
    sampled = np.maximum(log.sampled[kept], 1).astype(np.float64)
    poisson = log.sample_rate[kept]
    rates = np.where(np.isfinite(poisson), poisson, sampled / np.maximum(log.population[kept], 1))
    shift = 1.0 / (sigma * np.sqrt(sampled)) if log.mechanism.startswith("local") else np.full(len(rates), 1.0 / sigma)
    evidence = shift[:, None] * z - shift[:, None] ** 2 / 2
    rates = np.clip(rates, 0.0, 1.0)[:, None]
    with np.errstate(divide="ignore"):
        terms = np.logaddexp(np.log1p(-rates), np.log(rates) + evidence)
    return np.where(rates >= 1.0, evidence, terms).sum(axis=0)


def accountant_epsilon(log: CanaryLog, *, accountant: str = ACCOUNTANT) -> dict[str, Any]:
    """Client-level epsilon of the run's configuration by fedaudit's accountant, and without amplification by
    sampling (every released round charged in full, as Flower's own accountant charges)."""
    rounds = np.flatnonzero(log.released == 1)
    if log.mechanism.startswith("local"):
        rates = np.ones(len(rounds))
        note = (
            "local DP: each client's update is released with its own noise and the server sees who took part, so "
            "every released round is charged in full (q = 1), for a client sampled in every round"
        )
    elif np.isfinite(log.sample_rate[rounds]).all():
        rates = log.sample_rate[rounds]
        note = (
            "central DP: each round is a Gaussian mechanism with noise multiplier sigma on the sum of the clipped "
            "updates of clients sampled independently with probability q (Poisson, by the server, canary clients "
            f"too), composed by {accountant.upper()}"
        )
    else:
        rates = log.sampled[rounds] / log.population[rounds]
        note = (
            "central DP: each released round is a Gaussian mechanism with noise multiplier sigma on the average of "
            "the sampled clients' clipped updates, sampled at q = n / N (canary clients counted in both), composed "
            f"by {accountant.upper()}; Flower samples exactly n without replacement, accounted here as Poisson "
            "sampling at the same rate (the usual approximation, as in Andrew et al.)"
        )
    sigma = log.noise_multiplier
    events = [SGMEvent(noise_multiplier=sigma, sample_rate=float(q), steps=1) for q in rates]
    full = [SGMEvent(noise_multiplier=sigma, sample_rate=1.0, steps=len(rounds))]
    return {
        "accountant": accountant,
        "epsilon": compute_epsilon(events, delta=log.delta, accountant=accountant),
        "epsilon_without_sampling": compute_epsilon(full, delta=log.delta, accountant=accountant),
        "delta": log.delta,
        "noise_multiplier": sigma,
        "released_rounds": int(len(rounds)),
        "sample_rates": [float(q) for q in rates],
        "unit": "one client (client-level DP)",
        "note": note,
    }


def _roles(n_in: int, n_out: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Which included and excluded canaries chose the threshold (True) and which judged it: split_audit's draw."""
    rng = np.random.default_rng(seed)
    roles = []
    for n in (n_in, n_out):
        choose = np.zeros(n, dtype=bool)
        choose[rng.permutation(n)[: int(n * SPLIT_FRACTION)]] = True
        roles.append(choose)
    return roles[0], roles[1]


def audit_log(
    path: str | Path, *, seed: int | None = None, resamples: int = DEFAULT_RESAMPLES, accountant: str = ACCOUNTANT
) -> FlowerAudit:
    """Estimates and rigorous bounds of epsilon from the Flower canary log at ``path`` (see :func:`audit`).

    Raises:
        CanaryLogError: the file is not a whole log of this version.
        AttackError: the log cannot be audited (too few canaries on a side).
    """
    return audit(read_log(path), source=str(path), seed=seed, resamples=resamples, accountant=accountant)


def _view_metrics(
    view: FlowerView,
    score: np.ndarray,
    included: np.ndarray,
    log: CanaryLog,
    budget: dict[str, Any],
    split_seed: int,
    boot_seed: int,
    resamples: int,
) -> dict[str, Any]:
    """One view's bounds, estimate and AUC, against the accountant's epsilon."""
    inside, outside = score[included], score[~included]
    bounds = {
        name: split_audit(inside, outside, estimator=name, delta=log.delta, confidence=LEVEL, seed=split_seed)
        for name in ESTIMATORS
    }
    estimate = gaussian_estimate(inside, outside, delta=log.delta, seed=boot_seed, resamples=resamples)
    auc_boot = bootstrap(included.astype(int), score, rng=np.random.default_rng(boot_seed), resamples=resamples)
    bound = max(b.epsilon for b in bounds.values())
    return {
        "threat_model": view.threat_model,
        "score": view.score,
        "num_members": int(inside.size),
        "num_nonmembers": int(outside.size),
        "auc": auc_score(included, score),
        "auc_ci95": list(Bootstrap.interval(auc_boot.auc)),
        "epsilon_lower_bound": bound,
        "estimators": {name: b.to_dict() for name, b in bounds.items()},
        "ratio_to_accountant": _ratio(bound, budget["epsilon"]),
        "estimate": estimate.to_dict(),
        "estimate_ratio_to_accountant": _ratio(estimate.epsilon, budget["epsilon"]),
        "excluded_scores": {
            "mean": float(outside.mean()),
            "sd": float(outside.std(ddof=1)),
            "n": int(outside.size),
            "closed_form_sd": 1.0 / math.sqrt(log.dimension) if view is FINAL_MODEL else None,
        },
        "bound_by_guesses": bound_by_guesses(inside, outside, delta=log.delta, confidence=LEVEL),
    }


def _log_warnings(log: CanaryLog) -> list[str]:
    """What in the log weakens Flower's guarantee or the audit: rounds of unequal weights, rounds without a release."""
    unequal = [int(t) + 1 for t in np.flatnonzero((log.equal_weights == 0) & (log.released == 1))]
    warnings = []
    if unequal:
        warnings.append(
            f"rounds {unequal} aggregated replies of unequal weights: Flower's DP noise assumes equal weights, so a "
            "client of the largest weight (the canary clients take it) has less privacy than the accountant says"
        )
    if not log.released.all():
        warnings.append(f"rounds {[int(t) + 1 for t in np.flatnonzero(log.released == 0)]} released no aggregate")
    return warnings


def audit(
    log: CanaryLog,
    *,
    source: str,
    seed: int | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    accountant: str = ACCOUNTANT,
) -> FlowerAudit:
    """Each view's estimates and bounds of epsilon, against the accountant and Flower.

    Args:
        log: a checked log.
        source: where it came from (recorded in metrics.json).
        seed: the seed of the canary halves and the bootstrap. [default: the log's seed]
        resamples: bootstrap resamples of the intervals.
        accountant: fedaudit's accountant (``rdp`` or ``prv``).
    """
    seed = log.seed if seed is None else seed
    included = log.included.astype(bool)
    if included.sum() < 2 or (~included).sum() < 2:
        raise AttackError(
            f"{source} has {int(included.sum())} included canaries of {log.canaries}; the audit needs "
            "at least two included and two excluded."
        )
    split_seed = derive_seed(seed, Stream.ATTACK, Draw.CANARY_SPLIT)
    boot_seed = derive_seed(seed, Stream.ATTACK, Draw.BOOTSTRAP)
    budget = accountant_epsilon(log, accountant=accountant)
    scores = view_scores(log)
    choose_in, choose_out = _roles(int(included.sum()), int((~included).sum()), split_seed)
    table: dict[str, Any] = {"canary": np.arange(log.canaries), "included": included.astype(int)}
    role = np.empty(log.canaries, dtype=object)
    role[included], role[~included] = np.where(choose_in, "choose", "judge"), np.where(choose_out, "choose", "judge")
    curves, views = [], {}
    for view in VIEWS:
        score = scores[view.name]
        views[view.name] = _view_metrics(view, score, included, log, budget, split_seed, boot_seed, resamples)
        table[view.name] = score
        table[f"bound_role_{view.name}"] = role
        curve = roc(included.astype(int), score)
        curves.append(
            pd.DataFrame({"view": view.name, "fpr": curve.fpr, "tpr": curve.tpr, "threshold": curve.thresholds})
        )
    largest = max(v["epsilon_lower_bound"] for v in views.values())
    warnings = _log_warnings(log)
    metrics = {
        "attack": "flower-canaries",
        "method": "canary",
        "log": source,
        "log_format": {"name": FORMAT, "version": VERSION},
        "seed": seed,
        "canaries": log.canaries,
        "canaries_included": int(included.sum()),
        "canaries_excluded": int((~included).sum()),
        "rounds": log.rounds,
        "dimension": log.dimension,
        "mechanism": log.mechanism,
        "strategy": log.strategy,
        "noise_multiplier": log.noise_multiplier,
        "clipping_norm": log.clipping_norm,
        "canary_norm_before_clipping": log.scale * log.clipping_norm,
        "delta": log.delta,
        "epsilon_lower_bound": largest,
        "epsilon_lower_bound_confidence": CONFIDENCE,
        "per_estimator_confidence": LEVEL,
        "accountant_epsilon": budget["epsilon"],
        "epsilon_lower_bound_exceeds_accountant": bool(largest > budget["epsilon"]),
        "ratio_to_accountant": _ratio(largest, budget["epsilon"]),
        "accountant": budget,
        "flower": {
            "epsilon": None if math.isnan(log.flower_epsilon) else log.flower_epsilon,
            "delta": None if math.isnan(log.flower_delta) else log.flower_delta,
            "report": log.flower_report,
            "version": log.flower_version,
        },
        "views": views,
        "warnings": warnings,
        "note": "the one-run and Gaussian-DP bounds are lower bounds at 95% (all four together); the estimates are "
        "estimates, not bounds: they assume Gaussian scores and may lie above the accountant for a correct run",
    }
    return FlowerAudit(metrics, pd.DataFrame(table), pd.concat(curves, ignore_index=True))


CLIENT_RESULTS = {view.name: f"canary-clients-{view.name}" for view in VIEWS}  # a run's results, by view


def client_canary_results(path: Path, *, seed: int) -> list[tuple[str, dict[str, Any], pd.DataFrame, pd.DataFrame]]:
    """The audit of a client-level DP run's canary clients (its ``canary-clients.npz``, the same log and the same
    estimators as a Flower app's), as one attack result per view: (name, metrics, scores, roc), the metrics in the
    shape of every canary audit's (``canary_audit``: counts, threat model, estimators, estimate, bound by guesses),
    against the log's client-level epsilon."""
    log = read_log(path)
    audited = audit(log, source=str(path), seed=seed)
    results = []
    for view in VIEWS:
        numbers = audited.metrics["views"][view.name]
        canary_audit = {
            "canaries": log.canaries,
            "canary_kind": "client",
            "threat_model": numbers["threat_model"],
            "score": numbers["score"],
            "per_estimator_confidence": LEVEL,
            "informative_canaries": None,
            "estimate": numbers["estimate"],
            "estimators": numbers["estimators"],
            "bound_by_guesses": numbers["bound_by_guesses"],
        }
        metrics = {
            "auc": numbers["auc"],
            "auc_ci95": numbers["auc_ci95"],
            "num_members": numbers["num_members"],
            "num_nonmembers": numbers["num_nonmembers"],
            "epsilon_lower_bound": numbers["epsilon_lower_bound"],
            "epsilon_lower_bound_confidence": CONFIDENCE,
            "accountant_epsilon": audited.metrics["accountant_epsilon"],
            "accountant": audited.metrics["accountant"],
            "canary_audit": canary_audit,
            "warnings": audited.metrics["warnings"],
        }
        columns = ["canary", "included", view.name, f"bound_role_{view.name}"]
        scores = audited.scores[columns].rename(columns={view.name: "score", f"bound_role_{view.name}": "bound_role"})
        curve = audited.roc[audited.roc["view"] == view.name].drop(columns="view").reset_index(drop=True)
        results.append((CLIENT_RESULTS[view.name], metrics, scores, curve))
    return results


def _ratio(value: float, budget: float) -> float | None:
    return None if not budget or math.isinf(budget) else float(value / budget)


def default_out(path: str | Path) -> Path:
    """Where the results go without --out: beside the log, named after it (``canaries.npz`` -> ``canaries-audit``)."""
    path = Path(path)
    return path.with_name(f"{path.stem}-audit")


def check_out(out: Path) -> None:
    """Refuse, before anything is computed, an --out that is a file."""
    if out.exists() and not out.is_dir():
        raise AttackError(f"--out {out} is a file; give a folder for the results.")


def write_results(audit: FlowerAudit, out: Path) -> Path:
    """The result directory like every attack's: scores.csv and roc.csv, then metrics.json, each atomically (an
    earlier metrics.json is removed first, so that a half-written result never looks complete)."""
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").unlink(missing_ok=True)
    atomic_write_bytes(out / "scores.csv", csv_bytes(audit.scores))
    atomic_write_bytes(out / "roc.csv", csv_bytes(audit.roc))
    atomic_write_bytes(out / "metrics.json", json_bytes(audit.metrics))
    return out


def console_table(audit: FlowerAudit) -> str:
    """The command's table: each view's AUC, bounds and estimate with interval and n, then the epsilons they face."""
    m = audit.metrics
    rows = []
    for name, view in m["views"].items():
        one, gdp, est = view["estimators"]["one-run"], view["estimators"]["gdp"], view["estimate"]
        rows.append(
            {
                "view": name,
                "canaries in/out": f"{view['num_members']}/{view['num_nonmembers']}",
                "AUC [95% CI]": f"{view['auc']:.3f} [{view['auc_ci95'][0]:.3f}, {view['auc_ci95'][1]:.3f}]",
                "one-run eps >= (n in/out)": f"{one['epsilon']:.3f} ({one['canaries_in']}/{one['canaries_out']})",
                "GDP eps >= (n in/out)": f"{gdp['epsilon']:.3f} ({gdp['canaries_in']}/{gdp['canaries_out']})",
                "estimate eps [95% CI]": f"{est['epsilon']:.3f} [{est['ci95'][0]:.3f}, {est['ci95'][1]:.3f}]",
            }
        )
    budget, flower = m["accountant"], m["flower"]
    verdict = "ABOVE" if m["epsilon_lower_bound_exceeds_accountant"] else "not above"
    lines = [
        f"Flower canary audit of {m['log']}: {m['canaries']} canaries ({m['canaries_included']} included), "
        f"{m['rounds']} rounds, {m['dimension']} parameters",
        f"{m['mechanism']} ({m['strategy']}): sigma {m['noise_multiplier']:g}, C {m['clipping_norm']:g}, "
        f"delta {m['delta']:g}",
        pd.DataFrame(rows).to_string(index=False),
        f"bounds at {m['per_estimator_confidence']:.4g} each, the largest at "
        f"{m['epsilon_lower_bound_confidence']:.0%}: epsilon >= {m['epsilon_lower_bound']:.3f}, {verdict} the "
        "accountant's epsilon",
        f"accountant ({budget['accountant']}, client-level, q = n / N per round): epsilon {budget['epsilon']:.4g} at "
        f"delta {budget['delta']:g} over {budget['released_rounds']} rounds; every round in full: "
        f"{budget['epsilon_without_sampling']:.4g}",
        f"Flower {flower['version']}: {flower['report']}",
        *(f"warning: {w}" for w in m["warnings"]),
    ]
    return "\n".join(lines)

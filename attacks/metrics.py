"""Audit metrics: ROC and AUC with a bootstrap interval, TPR at low FPR and advantage measured on held-out records
with their intervals, and a valid empirical epsilon lower bound.

Every rate comes with its interval and the number of records behind it. Tests
whose threshold must be chosen (TPR at a target FPR, the best advantage, the
epsilon bound) are chosen on the attack-training half of the records and
measured on the audit half, so that the choice does not flatter the number. A
TPR at a false-positive rate below 1 / (number of non-members) cannot be
measured (the smallest non-zero FPR a sample can show is one in n), so it is
reported as not estimable, with the number of non-members it would need.

The epsilon lower bound (docs/audit.md): an (eps, delta)-DP mechanism makes every
membership test fixed in advance obey TPR <= e^eps FPR + delta and
TNR <= e^eps FNR + delta. For one such test, one-sided Clopper-Pearson bounds
(TPR or TNR from below, FPR or FNR from above) give
eps >= log((TPR_lo - delta) / FPR_hi) with the stated confidence. The test must
not be chosen on the records it is judged on: taking the best of a thousand
thresholds of the same scores is a multiple-comparison error that makes pure
noise look like leakage in about a third of samples. So the threshold and the
inequality are chosen on one part of the records (the attack-training half) and
the bound is computed on the other (the audit half), which the choice never saw:
one test, one bound, valid at the stated confidence. Only tests in the attack's
own direction (high score: member) are considered, so an attack that does worse
than chance gives no bound (0).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.stats import beta, norm

from fedaudit.attacks.options import DEFAULT_RESAMPLES
from fedaudit.errors import UserError

LOW_FPRS: tuple[float, ...] = (0.01, 0.001)
CONFIDENCE = 0.95
_BOOTSTRAP_CELLS = 4_000_000  # resamples x records held in memory at once

# The two inequalities an (eps, delta)-DP membership test obeys, in the attack's own direction.
INEQUALITIES: dict[str, str] = {
    "tpr": "TPR <= exp(eps) * FPR + delta (records with score >= threshold called members)",
    "tnr": "TNR <= exp(eps) * FNR + delta (records with score < threshold called non-members)",
}
BOUND_PROCEDURE = (
    "one test chosen on the attack-training half (threshold and inequality with the largest bound there), "
    "then one-sided Clopper-Pearson bounds on the audit half, each rate at 1 - (1 - confidence) / 2 so that the "
    "bound holds at the stated confidence"
)


@dataclass(frozen=True)
class ROC:
    """Points of the ROC curve, one per distinct score threshold (a record is a member if score >= threshold)."""

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray


def roc(member: np.ndarray, score: np.ndarray) -> ROC:
    """Every point of the ROC curve, one per distinct score from the highest, after (0, 0) at threshold +inf: what
    scikit-learn's ``roc_curve(member, score, drop_intermediate=False)`` gives, to the bit (tested against it),
    without importing scikit-learn (2-3 s of every attack's start-up)."""
    fps, tps, thresholds = _counts_at_thresholds(member, score)
    fpr, tpr = _rates(fps, tps)
    return ROC(fpr=fpr, tpr=tpr, thresholds=np.concatenate([[np.inf], thresholds.astype(np.float64)]))


def auc_score(member: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve by the trapezoidal rule over its corners (collinear points dropped first): what
    scikit-learn's ``roc_auc_score`` gives, to the bit (tested against it).

    Raises:
        ValueError: one class only, or a score that is not finite (as scikit-learn does).
    """
    fps, tps, _ = _counts_at_thresholds(member, score)
    if len(fps) > 2:
        corners = np.flatnonzero(np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True])
        fps, tps = fps[corners], tps[corners]
    fpr, tpr = _rates(fps, tps)
    return float(np.trapezoid(tpr, fpr))


def _rates(fps: np.ndarray, tps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FPR and TPR at each threshold, after (0, 0)."""
    return np.concatenate([[0.0], fps]) / fps[-1], np.concatenate([[0.0], tps]) / tps[-1]


class ScoreError(UserError):
    """Labels or scores a metric cannot use (one sentence)."""


def check_level(delta: float, confidence: float, *, positive_delta: bool = False) -> None:
    """``delta`` in [0, 1) (in (0, 1) where the epsilon of a Gaussian-DP parameter is read at it) and
    ``confidence`` in (0, 1), or one sentence."""
    real = numbers.Real
    if (
        not isinstance(delta, real)
        or isinstance(delta, bool)
        or not (0 < delta < 1 or (delta == 0 and not positive_delta))
    ):
        kind = "in (0, 1)" if positive_delta else "in [0, 1)"
        raise ScoreError(f"delta must be a number {kind}, got {delta!r}.")
    if not isinstance(confidence, real) or isinstance(confidence, bool) or not 0 < confidence < 1:
        raise ScoreError(f"confidence must be a number in (0, 1), got {confidence!r}.")


def as_array(values: Any) -> np.ndarray:
    """Scores, labels or marks from anywhere as a numpy array, by position: numpy, lists, pandas (its values, never
    its index) and torch tensors on any device."""
    return np.asarray(values.detach().cpu() if hasattr(values, "detach") else values)


def _labelled(member: Any, score: Any) -> tuple[np.ndarray, np.ndarray]:
    """Labels and scores as flat arrays, by position (lists, pandas and torch's CPU tensors too), refused unless of
    one length, labels 0 or 1 and scores finite."""
    member, score = (as_array(x).ravel() for x in (member, score))
    if member.shape != score.shape:
        raise ScoreError(f"{member.size} membership labels for {score.size} scores.")
    try:
        score = score.astype(np.float64)
    except (TypeError, ValueError):
        raise ScoreError("Scores must be numbers.") from None
    if not np.isfinite(score).all():
        raise ScoreError("Scores must be finite to draw a ROC curve.")
    labels = set(np.unique(member).tolist())
    if not labels <= {0, 1}:
        raise ScoreError(f"Membership labels must be 0 or 1, got {sorted(labels)}.")
    return member.astype(np.int64), score


def _counts_at_thresholds(member: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """False and true positives (float64) at each distinct score taken as the threshold, from the highest, and
    those scores."""
    member, score = _labelled(member, score)
    if len(set(member.tolist())) != 2:
        raise ScoreError("Only one class present in the membership labels: a ROC curve needs members and non-members.")
    order = np.argsort(score, kind="stable")[::-1]
    sorted_score = score[order]
    positives = (member[order] == 1).astype(np.float64)
    cut = np.r_[np.flatnonzero(np.diff(sorted_score)), len(sorted_score) - 1]
    tps = np.cumsum(positives, dtype=np.float64)[cut]
    fps = 1 + cut.astype(np.float64) - tps
    return fps, tps, sorted_score[cut]


def advantage(curve: ROC) -> float:
    """Membership advantage max over thresholds of TPR - FPR on the same records (optimistic: a description, not an
    estimate; :func:`held_out_advantage` is the estimate)."""
    return float(np.max(curve.tpr - curve.fpr))


def rate_interval(successes: int, trials: int, *, level: float = CONFIDENCE) -> list[float]:
    """Two-sided Clopper-Pearson interval of a binomial proportion at ``level``."""
    tail = (1.0 + level) / 2.0
    low = clopper_pearson_lower(np.array([successes]), trials, confidence=tail)[0]
    high = clopper_pearson_upper(np.array([successes]), trials, confidence=tail)[0]
    return [float(low), float(high)]


def rates_at_fpr(member: np.ndarray, score: np.ndarray, select: np.ndarray, target: float) -> dict[str, Any]:
    """TPR and FPR of the test set to FPR <= ``target`` on the choosing records, measured on the others.

    The threshold is the "higher" (1 - target) quantile of the non-members' scores among
    the ``select`` records, so at most a fraction ``target`` of them score above it; the
    rates of "score > threshold" are then measured on the records outside ``select``,
    with two-sided 95% Clopper-Pearson intervals. Choosing the threshold on the same
    non-members it is judged on would let a test at 2-4 times the target FPR pass for
    one at the target. Records tied at the threshold count as non-members on both halves.

    Not estimable (``estimable`` false, ``reason`` saying why) when either part has fewer than
    ``nonmembers_needed`` = 1/target non-members (no threshold can resolve the FPR), or when the
    FPR the test reached on the audit half has an interval that lies wholly above the target: the
    scores do not resolve that FPR (ties, or a cluster of near-equal scores at the threshold), so its TPR
    is a rate at another FPR. The measured rates are kept beside the verdict.
    """
    needed = math.ceil(1.0 / target - 1e-9)
    select = np.asarray(select, dtype=bool)
    reference = score[select & (member == 0)]
    members, nonmembers = score[~select & (member == 1)], score[~select & (member == 0)]
    base = {
        "target_fpr": target,
        "num_members": int(members.size),
        "num_nonmembers": int(nonmembers.size),
        "num_reference_nonmembers": int(reference.size),
        "nonmembers_needed": needed,
    }
    if min(reference.size, nonmembers.size) < needed or members.size == 0:
        reason = (
            f"{min(reference.size, nonmembers.size)} non-members per half cannot resolve an FPR of {target:g} "
            f"(needs {needed})"
        )
        empty = {"threshold": None, "tpr": None, "ci95": None, "fpr": None, "fpr_ci95": None}
        return {**base, "estimable": False, "reason": reason, **empty}
    threshold = float(np.quantile(reference, 1.0 - target, method="higher"))
    hits, false_alarms = int((members > threshold).sum()), int((nonmembers > threshold).sum())
    fpr_ci = rate_interval(false_alarms, nonmembers.size)
    reached = {
        "threshold": threshold,
        "tpr": hits / members.size,
        "ci95": rate_interval(hits, members.size),
        "fpr": false_alarms / nonmembers.size,
        "fpr_ci95": fpr_ci,
    }
    if fpr_ci[0] > target:
        reason = (
            f"the test chosen for FPR {target:g} reached FPR {false_alarms / nonmembers.size:.3f} "
            f"[{fpr_ci[0]:.3f}, {fpr_ci[1]:.3f}] on the audit half: the scores do not resolve that FPR"
        )
        return {**base, "estimable": False, "reason": reason, **reached}
    return {**base, "estimable": True, "reason": None, **reached}


def wilson_interval(successes: int, trials: int, z: float) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    p = successes / trials
    centre = (successes + z * z / 2.0) / (trials + z * z)
    half = z * math.sqrt(p * (1.0 - p) * trials + z * z / 4.0) / (trials + z * z)
    return centre - half, centre + half


def difference_interval(
    hits: int, positives: int, false_alarms: int, negatives: int, level: float = CONFIDENCE
) -> list[float]:
    """Newcombe's hybrid score interval of TPR - FPR from two independent binomial samples (Newcombe 1998, method
    10): Wilson intervals of each rate, combined."""
    z = float(norm.ppf((1.0 + level) / 2.0))
    p1, p0 = hits / positives, false_alarms / negatives
    l1, u1 = wilson_interval(hits, positives, z)
    l0, u0 = wilson_interval(false_alarms, negatives, z)
    d = p1 - p0
    return [d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2)]


def held_out_advantage(member: np.ndarray, score: np.ndarray, select: np.ndarray) -> dict[str, Any]:
    """TPR - FPR of the threshold that maximises it on the ``select`` records, measured on the others with Newcombe's
    95% interval.

    The largest TPR - FPR over every threshold of the same records is optimistic (on
    pure noise its bootstrap interval excludes 0 almost always); a threshold fixed on
    other records is not.
    """
    select = np.asarray(select, dtype=bool)
    members, nonmembers = score[~select & (member == 1)], score[~select & (member == 0)]
    chosen = member[select]
    if members.size == 0 or nonmembers.size == 0 or chosen.min(initial=1) == chosen.max(initial=0):
        return {
            "advantage": None,
            "ci95": None,
            "threshold": None,
            "num_members": int(members.size),
            "num_nonmembers": int(nonmembers.size),
        }
    curve = roc(chosen, score[select])
    gaps = curve.tpr - curve.fpr
    gaps[0] = -np.inf  # "nobody is a member": an infinite threshold, never the best
    threshold = _between(curve, int(np.argmax(gaps)))
    hits, false_alarms = int((members >= threshold).sum()), int((nonmembers >= threshold).sum())
    return {
        "advantage": hits / members.size - false_alarms / nonmembers.size,
        "ci95": difference_interval(hits, members.size, false_alarms, nonmembers.size),
        "threshold": threshold,
        "tpr": hits / members.size,
        "fpr": false_alarms / nonmembers.size,
        "num_members": int(members.size),
        "num_nonmembers": int(nonmembers.size),
    }


def _between(curve: ROC, index: int) -> float:
    """The threshold of ROC point ``index``, moved halfway to the next lower score: the same test on these records,
    a less brittle one elsewhere."""
    threshold = curve.thresholds[index]
    if index + 1 < curve.thresholds.size:
        threshold = (threshold + curve.thresholds[index + 1]) / 2.0
    return float(threshold)


@dataclass(frozen=True)
class Bootstrap:
    """The AUC of each bootstrap resample (members and non-members resampled separately)."""

    auc: np.ndarray

    @staticmethod
    def interval(values: np.ndarray, level: float = CONFIDENCE) -> tuple[float, float]:
        """Percentile interval at ``level``."""
        low, high = np.quantile(values, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
        return float(low), float(high)


def resample_counts(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """``size`` bootstrap resamples of ``n`` records, as counts [size, n]: how often each record was drawn in n draws
    with replacement, i.e. rows of Multinomial(n, 1/n), counted from the drawn indices (six times faster than
    numpy's multinomial at n = 900: 4.3-4.8x, benchmarks/bootstrap.py)."""
    drawn = rng.integers(0, n, size=(size, n)) + (np.arange(size) * n)[:, None]
    return np.bincount(drawn.ravel(), minlength=size * n).reshape(size, n)


def bootstrap(
    member: np.ndarray, score: np.ndarray, *, rng: np.random.Generator, resamples: int = DEFAULT_RESAMPLES
) -> Bootstrap:
    """The AUC of ``resamples`` bootstrap resamples, vectorised: each resample is a vector of multinomial counts per
    side, and :func:`weighted_auc` evaluates many such vectors at once without re-sorting."""
    positives, negatives = score[member == 1], score[member == 0]
    n1, n0 = positives.size, negatives.size
    aucs = np.empty(resamples)
    chunk = max(1, _BOOTSTRAP_CELLS // (n1 + n0))
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        w1, w0 = resample_counts(rng, n1, size), resample_counts(rng, n0, size)
        aucs[start : start + size] = weighted_auc(positives, negatives, w1, w0)
    return Bootstrap(auc=aucs)


def bootstrap_groups(
    negatives: np.ndarray,
    positives: Sequence[np.ndarray],
    *,
    rng: np.random.Generator,
    resamples: int = DEFAULT_RESAMPLES,
) -> list[Bootstrap]:
    """:func:`bootstrap` of many positive sets against one negative set (a federation's clients against the
    non-members of their classes), with the negatives' resamples drawn once and shared: each resample's cumulative
    negative counts are computed once, and every set of positives needs only its own counts and a lookup. Each
    interval is a valid bootstrap of its own AUC; those of different sets share their negative draws.

    A set's resample r is its n1 positives drawn n1 times with replacement against the n0 negatives drawn n0 times
    (the latter common to every set), as in :func:`bootstrap` (:func:`resample_counts`).
    """
    n0 = negatives.size
    order = np.argsort(negatives, kind="stable")
    sorted_negatives = negatives[order]
    aucs = [np.empty(resamples) for _ in positives]
    chunk = max(1, _BOOTSTRAP_CELLS // max(n0, 1))
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        w0 = resample_counts(rng, n0, size)[:, order]
        cumulative = np.concatenate([np.zeros((size, 1)), np.cumsum(w0, axis=1)], axis=1)
        for auc, pos in zip(aucs, positives):
            n1 = pos.size
            w1 = resample_counts(rng, n1, size)
            below = np.searchsorted(sorted_negatives, pos, side="left")
            at_or_below = np.searchsorted(sorted_negatives, pos, side="right")
            wins = 0.5 * (cumulative[:, below] + cumulative[:, at_or_below])
            auc[start : start + size] = (w1 * wins).sum(axis=1) / (n1 * n0)
    return [Bootstrap(auc=a) for a in aucs]


def weighted_auc(positives: np.ndarray, negatives: np.ndarray, w_pos: np.ndarray, w_neg: np.ndarray) -> np.ndarray:
    """AUC of each row of counts: positive i counted ``w_pos[r, i]`` times, negative j ``w_neg[r, j]`` times.

    The count-weighted Mann-Whitney statistic (ties count one half), from the sorted
    negative scores and one searchsorted per positive, so no resample is sorted again.
    """
    order = np.argsort(negatives, kind="stable")
    sorted_negatives = negatives[order]
    below = np.searchsorted(sorted_negatives, positives, side="left")
    at_or_below = np.searchsorted(sorted_negatives, positives, side="right")
    w_neg = np.atleast_2d(w_neg)[:, order]
    cumulative = np.concatenate([np.zeros((w_neg.shape[0], 1)), np.cumsum(w_neg, axis=1)], axis=1)
    wins = 0.5 * (cumulative[:, below] + cumulative[:, at_or_below])
    return (np.atleast_2d(w_pos) * wins).sum(axis=1) / (np.atleast_2d(w_pos).sum(axis=1) * w_neg.sum(axis=1))


def clopper_pearson_lower(successes: np.ndarray, trials: int, *, confidence: float = CONFIDENCE) -> np.ndarray:
    """One-sided lower Clopper-Pearson bound of a binomial proportion (0 where there are no successes)."""
    k = np.asarray(successes, dtype=float)
    with np.errstate(invalid="ignore"):
        bound = beta.ppf(1.0 - confidence, k, trials - k + 1)
    return np.where(k > 0, bound, 0.0)


def clopper_pearson_upper(successes: np.ndarray, trials: int, *, confidence: float = CONFIDENCE) -> np.ndarray:
    """One-sided upper Clopper-Pearson bound of a binomial proportion (1 where every trial succeeded)."""
    k = np.asarray(successes, dtype=float)
    with np.errstate(invalid="ignore"):
        bound = beta.ppf(confidence, k + 1, trials - k)
    return np.where(k < trials, bound, 1.0)


def rate_level(confidence: float) -> float:
    """The level of each of an epsilon bound's two one-sided rate bounds, so that both hold at ``confidence``."""
    return 1.0 - (1.0 - confidence) / 2.0


def threshold_bounds(
    true_positives: np.ndarray,
    false_positives: np.ndarray,
    positives: int,
    negatives: int,
    *,
    delta: float,
    confidence: float = CONFIDENCE,
) -> dict[str, np.ndarray]:
    """The epsilon bound of each test, by inequality, from its confusion counts (-inf where it gives none).

    A test calls a record a member when its score is at or above the threshold;
    ``true_positives[i]`` and ``false_positives[i]`` are its counts. Each entry is a
    valid bound at ``confidence`` only for a test fixed before these counts were seen.
    The bound needs both of its rates to hold, so each one-sided Clopper-Pearson bound
    is taken at 1 - (1 - ``confidence``) / 2 (Bonferroni): at 95% each, the two together
    held with probability 90% only.
    """
    tp = np.asarray(true_positives, dtype=float)
    fp = np.asarray(false_positives, dtype=float)
    each = rate_level(confidence)
    tpr_lo = clopper_pearson_lower(tp, positives, confidence=each)
    fpr_hi = clopper_pearson_upper(fp, negatives, confidence=each)
    tnr_lo = clopper_pearson_lower(negatives - fp, negatives, confidence=each)
    fnr_hi = clopper_pearson_upper(positives - tp, positives, confidence=each)
    with np.errstate(divide="ignore", invalid="ignore"):
        bounds = {"tpr": np.log((tpr_lo - delta) / fpr_hi), "tnr": np.log((tnr_lo - delta) / fnr_hi)}
    return {name: np.where(np.isnan(b), -np.inf, b) for name, b in bounds.items()}


@dataclass(frozen=True)
class EpsilonBound:
    """An empirical epsilon lower bound and the one test it comes from (metrics.json's ``epsilon_lower_bound_test``).

    ``epsilon`` is 0 when the chosen test gives no positive bound on the bound records, and
    when no test gives a finite bound on the selection records (``threshold`` and
    ``inequality`` are then None). Counts and rates are those of the bound records;
    ``rate_lower`` is TPR_lo or TNR_lo, ``rate_upper`` FPR_hi or FNR_hi, each at :func:`rate_level`.
    """

    epsilon: float
    confidence: float
    delta: float
    threshold: float | None
    inequality: str | None
    selection_members: int
    selection_nonmembers: int
    bound_members: int
    bound_nonmembers: int
    true_positives: int | None = None
    false_positives: int | None = None
    rate_lower: float | None = None
    rate_upper: float | None = None
    selection_bound: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "procedure": BOUND_PROCEDURE,
            "inequality_text": None if self.inequality is None else INEQUALITIES[self.inequality],
        }


def choose_test(
    member: np.ndarray, score: np.ndarray, *, delta: float, confidence: float = CONFIDENCE
) -> tuple[float, str, float] | None:
    """The threshold and inequality whose bound is largest on these records, and that bound (possibly <= 0, since
    the bound on other records may still be positive); None if no test gives a finite bound here.

    Of equal bounds the highest threshold wins; the threshold returned lies halfway between
    it and the next lower score (:func:`_between`).
    """
    curve = roc(member, score)
    positives, negatives = int((member == 1).sum()), int((member == 0).sum())
    bounds = threshold_bounds(
        np.rint(curve.tpr * positives),
        np.rint(curve.fpr * negatives),
        positives,
        negatives,
        delta=delta,
        confidence=confidence,
    )
    for values in bounds.values():
        values[0] = -np.inf  # "nobody is a member" (an infinite threshold) bounds nothing
    name = max(bounds, key=lambda k: bounds[k].max())
    best = int(np.argmax(bounds[name]))
    if not np.isfinite(bounds[name][best]):
        return None
    return _between(curve, best), name, float(bounds[name][best])


def epsilon_lower_bound(
    member: np.ndarray, score: np.ndarray, select: np.ndarray, *, delta: float, confidence: float = CONFIDENCE
) -> EpsilonBound:
    """A valid one-sided lower bound on epsilon at ``delta``: one test chosen on the records where ``select`` is
    true, judged on the others (module docstring).

    Args:
        member: 1 for members, 0 for non-members.
        score: membership scores, higher meaning member.
        select: the records the test is chosen on; the bound uses only the rest.
        delta: the delta of the guarantee being tested.
        confidence: the one-sided confidence of the bound.

    Returns:
        The bound and the test it comes from.
    """
    check_level(delta, confidence)
    member, score = _labelled(member, score)
    select = as_array(select).ravel()
    if select.shape != member.shape or not set(np.unique(select).tolist()) <= {0, 1}:
        raise ScoreError(f"select must mark each of the {member.size} records true or false.")
    select = select.astype(bool)
    judged = ~select
    counts = {
        "selection_members": int((member[select] == 1).sum()),
        "selection_nonmembers": int((member[select] == 0).sum()),
        "bound_members": int((member[judged] == 1).sum()),
        "bound_nonmembers": int((member[judged] == 0).sum()),
    }
    chosen = None
    if min(counts.values()) > 0:
        chosen = choose_test(member[select], score[select], delta=delta, confidence=confidence)
    if chosen is None:
        return EpsilonBound(0.0, confidence, delta, None, None, **counts)
    threshold, inequality, selection_bound = chosen
    called = score[judged] >= threshold
    tp = int((called & (member[judged] == 1)).sum())
    fp = int((called & (member[judged] == 0)).sum())
    positives, negatives = counts["bound_members"], counts["bound_nonmembers"]
    bound = threshold_bounds(np.array([tp]), np.array([fp]), positives, negatives, delta=delta, confidence=confidence)[
        inequality
    ][0]
    each = rate_level(confidence)
    if inequality == "tpr":
        lower = clopper_pearson_lower(np.array([tp]), positives, confidence=each)[0]
        upper = clopper_pearson_upper(np.array([fp]), negatives, confidence=each)[0]
    else:
        lower = clopper_pearson_lower(np.array([negatives - fp]), negatives, confidence=each)[0]
        upper = clopper_pearson_upper(np.array([positives - tp]), positives, confidence=each)[0]
    return EpsilonBound(
        max(0.0, float(bound)),
        confidence,
        delta,
        threshold,
        inequality,
        **counts,
        true_positives=tp,
        false_positives=fp,
        rate_lower=float(lower),
        rate_upper=float(upper),
        selection_bound=selection_bound,
    )


def summarize(
    member: np.ndarray,
    score: np.ndarray,
    *,
    report: np.ndarray,
    select: np.ndarray,
    delta: float,
    rng: np.random.Generator,
    resamples: int = DEFAULT_RESAMPLES,
) -> tuple[dict[str, Any], ROC]:
    """The metrics of one attack, and its ROC curve.

    Args:
        member, score: every record of the evaluation set and its membership score.
        report: the records the ROC, AUC and (optimistic, descriptive) advantage are computed on.
        select: the records the tests of the epsilon bound, of TPR at low FPR and of the
            held-out advantage are chosen on; they are judged on ``report`` records outside ``select``.
        delta: the run's delta.
        rng: draws the bootstrap resamples.
        resamples: bootstrap resamples of the AUC and advantage intervals.
    """
    m, s = member[report], score[report]
    curve = roc(m, s)
    adv = advantage(curve)
    boot = bootstrap(m, s, rng=rng, resamples=resamples)
    used = report | select
    bound = epsilon_lower_bound(member[used], score[used], select[used], delta=delta)
    metrics = {
        "auc": auc_score(m, s),
        "auc_ci95": list(boot.interval(boot.auc)),
        "auc_se": float(boot.auc.std(ddof=1)) if resamples > 1 else None,
        "bootstrap_resamples": resamples,
        "tpr_at_fpr": {
            f"{target:g}": rates_at_fpr(member[used], score[used], select[used], target) for target in LOW_FPRS
        },
        "balanced_accuracy": 0.5 + adv / 2.0,
        "advantage": adv,
        "advantage_held_out": held_out_advantage(member[used], score[used], select[used]),
        "epsilon_lower_bound": bound.epsilon,
        "epsilon_lower_bound_confidence": bound.confidence,
        "epsilon_lower_bound_method": BOUND_PROCEDURE,
        "epsilon_lower_bound_test": bound.to_dict(),
        "delta": delta,
        "direction": direction(list(boot.interval(boot.auc))),
    }
    return metrics, curve


def direction(auc_interval: list[float]) -> str:
    """ "inverted" when the whole 95% AUC interval is below 0.5 (members score lower than non-members: the score's
    orientation is wrong for this model, and flipping it would give 1 - AUC), "as expected" when it is above, else
    "undetermined". The AUC itself is always reported as measured."""
    low, high = auc_interval
    return "inverted" if high < 0.5 else "as expected" if low > 0.5 else "undetermined"


TOP_EXPOSED = 10


def risk(
    member: np.ndarray,
    score: np.ndarray,
    *,
    report: np.ndarray,
    select: np.ndarray,
    client: np.ndarray,
    label: np.ndarray,
    record: np.ndarray,
    source: np.ndarray,
    kind: np.ndarray | None = None,
    top: int = TOP_EXPOSED,
) -> dict[str, Any]:
    """Who is exposed: the ``top`` audited members with the highest scores, and TPR at 1% and 0.1% FPR per client
    and per class.

    A record's exposure is the fraction of audited non-members that score at least as high: the FPR at which a
    threshold test would catch it. Per client (per class), the test is judged among records alike: a threshold is
    chosen on the ``select`` non-members of that client's classes (of that class) for the FPR, and the TPR measured
    on that client's (class's) members outside ``select`` with its Clopper-Pearson interval, as :func:`rates_at_fpr`
    does for all members. Non-members of every class would let a client whose classes score high anyway (easy
    classes) show a high TPR at an FPR that its own classes' non-members exceed many times. ``kind``: what pairs a
    client's members with non-members (their class, the default; their site for sites that keep their records).
    """
    kind = label if kind is None else kind
    used = report | select
    judged_out = score[report & (member == 0)]
    members = np.flatnonzero(report & (member == 1))
    order = members[np.argsort(-score[members], kind="stable")[:top]]
    exposed = [
        {
            "record": int(record[i]),
            "source": str(source[i]),
            "client": int(client[i]),
            "label": int(label[i]),
            "score": float(score[i]),
            "exposure_fpr": float((judged_out >= score[i]).mean()) if judged_out.size else None,
        }
        for i in order
    ]

    def rates(group: np.ndarray, alike: np.ndarray) -> dict[str, Any]:
        sub = used & (group | ((member == 0) & alike))
        return {f"{target:g}": rates_at_fpr(member[sub], score[sub], select[sub], target) for target in LOW_FPRS}

    def of_client(k: int) -> dict[str, Any]:
        mine = (client == k) & (member == 1)
        return rates(mine, np.isin(kind, np.unique(kind[mine])))

    return {
        "most_exposed": exposed,
        "tpr_at_fpr_per_client": {str(k): of_client(k) for k in np.unique(client[member == 1]).tolist()},
        "tpr_at_fpr_per_class": {
            str(c): rates((label == c) & (member == 1), label == c) for c in np.unique(label[member == 1]).tolist()
        },
    }

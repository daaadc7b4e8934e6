"""Canary audits: epsilon lower bounds from guesses about canaries that were each included with probability 1/2.

Two estimators, each valid at a stated confidence (docs/audit.md):

- **One run** (Steinke, Nasr and Jagielski, NeurIPS 2023, "Privacy auditing with one (1) training run"). m canaries
  are included independently with probability 1/2. The auditor guesses "in" for the k+ highest scores and "out" for
  the k- lowest and abstains on the rest; r = k+ + k- guesses, v of them correct. Under (eps, delta)-DP the number
  of correct guesses is dominated by Binomial(r, e^eps / (1 + e^eps)) up to a delta term, so
  p(eps) = P[Binomial(r, q_eps) >= v] + 2 m delta max_i P[v > Binomial(r, q_eps) >= v - i] / i
  is a p-value for "the mechanism is (eps, delta)-DP", and the bound is the largest eps that it rejects at level
  1 - confidence (found by bisection, as in the paper's reference code).
- **Gaussian DP** (Nasr et al., USENIX Security 2023, "Tight auditing of differentially private machine learning"):
  at a threshold, one-sided Clopper-Pearson bounds give TPR_lo and FPR_hi; a mu-GDP mechanism has
  TPR <= Phi(Phi^-1(FPR) + mu), so mu >= Phi^-1(TPR_lo) - Phi^-1(FPR_hi), and the bound is the epsilon of that
  mu-GDP at delta. Tight for the Gaussian mechanism that DP-SGD is.

Choices that depend on the scores (how many guesses, which threshold) would make the bound invalid if they were
scanned on the same canaries they are judged on. :func:`audit_one_run` therefore scans a fixed grid of guess counts
and corrects for every one (Bonferroni), and :func:`audit_gdp` chooses its threshold on one half of the canaries
and judges it on the other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.optimize import brentq
from scipy.stats import binom, norm

from fedaudit.attacks.metrics import CONFIDENCE, clopper_pearson_lower, clopper_pearson_upper

# Guess counts scanned by the one-run audit, as fractions of the canaries (each half "in", half "out").
GUESS_FRACTIONS: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_BISECTION_STEPS = 30
_EPSILON_CEILING = 100.0


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P-value of "the mechanism is (epsilon, delta)-DP" after v correct of r guesses about m canaries.

    Steinke, Nasr and Jagielski 2023 (Proposition 5.2 and their reference code): the binomial tail at
    q = e^eps / (1 + e^eps), plus 2 m delta times the largest average of the binomial mass just below v.
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"Need 0 <= v <= r <= m, got v={v}, r={r}, m={m}.")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"Need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}.")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, q))
    if v == 0 or delta == 0:
        return min(tail, 1.0)
    below = binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[B = v-1], P[B = v-2], ..., P[B = 0]
    alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(tail + alpha * delta * 2 * m, 1.0)


def one_run_epsilon(m: int, r: int, v: int, *, delta: float, confidence: float = CONFIDENCE) -> float:
    """The largest epsilon that v correct of r guesses about m canaries reject at ``confidence`` (0 if none).

    Bisection as in the paper's reference code: the p-value grows with epsilon, and the returned epsilon keeps
    ``p(epsilon) < 1 - confidence``.
    """
    level = 1.0 - confidence
    if one_run_p_value(m, r, v, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while one_run_p_value(m, r, v, high, delta) < level:
        low, high = high, high + 1.0
        if high > _EPSILON_CEILING:
            return low
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        if one_run_p_value(m, r, v, middle, delta) < level:
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True)
class CanaryBound:
    """One canary audit's lower bound and everything needed to recompute it."""

    estimator: str  # "one-run" or "gdp"
    epsilon: float
    confidence: float
    delta: float
    canaries: int  # m: canaries audited (or, for gdp, in the judging half)
    guesses: int  # r (one-run) or the judging half's canaries (gdp)
    correct: int  # v (one-run) or true positives at the threshold (gdp)
    scanned: int  # choices the confidence was corrected for (one-run) or 1 (gdp: chosen on the other half)
    detail: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _guesses(included: np.ndarray, order: np.ndarray, k: int) -> tuple[int, int]:
    """(guesses, correct) when the k/2 highest scores are called "in" and the k/2 lowest "out"."""
    k_in, k_out = (k + 1) // 2, k // 2
    called_in, called_out = order[len(order) - k_in :], order[:k_out]
    return k_in + k_out, int(included[called_in].sum() + (1 - included[called_out]).sum())


def audit_one_run(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = CONFIDENCE,
    fractions: Sequence[float] = GUESS_FRACTIONS,
) -> CanaryBound:
    """The one-run bound from canary ``scores`` (higher: more likely included) and the secret ``included`` bits.

    Every guess count in ``fractions`` of the canaries is tried, each at confidence 1 - (1 - confidence) / K for
    the K counts tried (Bonferroni), so that the largest bound still holds at ``confidence``.
    """
    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=int)
    m = len(scores)
    if m == 0 or len(included) != m:
        raise ValueError("Need one inclusion bit per canary score, and at least one canary.")
    order = np.argsort(scores, kind="stable")
    counts = sorted({max(1, min(m, round(f * m))) for f in fractions})
    level = 1.0 - (1.0 - confidence) / len(counts)
    best: tuple[float, int, int] = (0.0, counts[-1], _guesses(included, order, counts[-1])[1])
    for k in counts:
        r, v = _guesses(included, order, k)
        epsilon = one_run_epsilon(m, r, v, delta=delta, confidence=level)
        if epsilon > best[0]:
            best = (epsilon, r, v)
    epsilon, r, v = best
    detail = {"guess_counts": counts, "per_test_confidence": level}
    return CanaryBound("one-run", epsilon, confidence, delta, m, r, v, len(counts), detail)


def gdp_epsilon(mu: float, delta: float) -> float:
    """Epsilon at ``delta`` of mu-Gaussian DP: the root of Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta."""
    if mu <= 0:
        return 0.0

    def gap(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    if gap(0.0) <= 0:
        return 0.0
    high = 1.0
    while gap(high) > 0:
        high *= 2
    return float(brentq(gap, 0.0, high, xtol=1e-12))


def gdp_mu(true_positives: int, positives: int, false_positives: int, negatives: int, confidence: float) -> float:
    """mu of Gaussian DP implied at ``confidence`` by one test: Phi^-1(TPR_lo) - Phi^-1(FPR_hi), each one-sided at
    sqrt(confidence) so that both hold together."""
    side = math.sqrt(confidence)
    tpr_lo = float(clopper_pearson_lower(np.array([true_positives]), positives, confidence=side)[0])
    fpr_hi = float(clopper_pearson_upper(np.array([false_positives]), negatives, confidence=side)[0])
    if tpr_lo <= 0 or fpr_hi >= 1:
        return 0.0
    return max(0.0, float(norm.ppf(tpr_lo) - norm.ppf(fpr_hi)))


def audit_gdp(
    scores: np.ndarray,
    included: np.ndarray,
    choose: np.ndarray,
    *,
    delta: float,
    confidence: float = CONFIDENCE,
) -> CanaryBound:
    """The Gaussian-DP bound: the threshold with the largest mu on the ``choose`` half, judged on the others."""
    scores, included, choose = np.asarray(scores, float), np.asarray(included, int), np.asarray(choose, bool)
    judge = ~choose
    pos, neg = int(included[judge].sum()), int((1 - included[judge]).sum())
    if pos == 0 or neg == 0 or not choose.any():
        return CanaryBound("gdp", 0.0, confidence, delta, int(judge.sum()), int(judge.sum()), 0, 1, {"mu": 0.0})
    threshold = _best_threshold(scores[choose], included[choose], confidence)
    called = scores[judge] >= threshold
    tp, fp = int((called & (included[judge] == 1)).sum()), int((called & (included[judge] == 0)).sum())
    mu = gdp_mu(tp, pos, fp, neg, confidence)
    detail = {
        "mu": mu,
        "threshold": threshold,
        "true_positives": tp,
        "false_positives": fp,
        "members": pos,
        "nonmembers": neg,
    }
    return CanaryBound(
        "gdp", gdp_epsilon(mu, delta), confidence, delta, int(judge.sum()), int(judge.sum()), tp, 1, detail
    )


def _best_threshold(scores: np.ndarray, included: np.ndarray, confidence: float) -> float:
    """The score threshold whose mu is largest on these canaries (the highest of equal ones)."""
    pos, neg = int(included.sum()), int((1 - included).sum())
    if pos == 0 or neg == 0:
        return float("inf")
    thresholds = np.unique(scores)[::-1]  # descending: calling more canaries "in" at each step
    order = np.argsort(-scores, kind="stable")
    ranked, members = scores[order], included[order]
    called = np.searchsorted(-ranked, -thresholds, side="right")  # canaries with score >= each threshold
    tp = np.concatenate([[0], np.cumsum(members)])[called]
    fp = called - tp
    side = math.sqrt(confidence)
    tpr_lo = clopper_pearson_lower(tp, pos, confidence=side)
    fpr_hi = clopper_pearson_upper(fp, neg, confidence=side)
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = np.where((tpr_lo > 0) & (fpr_hi < 1), norm.ppf(tpr_lo) - norm.ppf(fpr_hi), -np.inf)
    return float(thresholds[int(np.argmax(mu))])

"""Canary audits: epsilon lower bounds from the scores of canaries that were each included with probability 1/2.

Two estimators at a stated confidence (docs/audit.md). Both take the scores of the included ("in") and the excluded
("out") canaries, higher meaning more likely included, and call a canary "in" when its score is at least a
threshold. What fedaudit reports is :func:`split_audit`: the threshold chosen on half of the canaries, the bound
judged on the others. (Scanning the vertices of the ROC curve's upper convex hull with the confidence divided among
them, jax-privacy's default and what :func:`epsilon_one_run` does without a threshold, is not valid: the hull is
chosen from the data.) The arithmetic follows jax-privacy's ``jax_privacy.auditing.CanaryScoreAuditor`` (Apache
2.0), which a test checks it against.

- **One run** (Steinke, Nasr and Jagielski, NeurIPS 2023, "Privacy auditing with one (1) training run"). At a
  threshold, r canaries are guessed "in" and v of them are. Under (eps, delta)-DP the number of correct guesses is
  dominated by Binomial(r, e^eps / (1 + e^eps)) up to a delta term, so
  p(eps) = P[Binomial(r, q_eps) >= v] + 2 m delta max_i P[v > Binomial(r, q_eps) >= v - i] / i
  is a p-value for "the mechanism is (eps, delta)-DP"; the bound is the largest eps it rejects.
- **Gaussian DP** (Nasr et al., USENIX Security 2023, "Tight auditing of differentially private machine learning").
  One-sided Clopper-Pearson upper bounds on FPR and FNR give mu >= Phi^-1(1 - FPR_hi) - Phi^-1(FNR_hi) for a
  mu-GDP mechanism; the bound is the epsilon of that mu-GDP at delta. Tight for the Gaussian mechanism, and valid
  only for mechanisms whose trade-off curve is Gaussian (DP-SGD's subsampled Gaussian at the false-positive rates
  canaries resolve); on randomised response or Laplace noise it exceeds the true epsilon.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.optimize import brentq
from scipy.stats import beta, binom, norm

from fedaudit.attacks.metrics import CONFIDENCE, as_array, check_level
from fedaudit.errors import UserError

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


def one_run_epsilon(
    m: int, r: int, v: int, *, delta: float, confidence: float = CONFIDENCE, start: float = 0.0
) -> float:
    """The largest epsilon (at least ``start``) that v correct of r guesses about m canaries reject at
    ``confidence``; ``start`` if none: the root of p(eps) = 1 - confidence, bracketed by doubling."""
    level = 1.0 - confidence
    if one_run_p_value(m, r, v, start, 0.0) > level:  # not even without delta
        return start

    def objective(eps: float) -> float:
        return level - one_run_p_value(m, r, v, eps, delta)

    if objective(start) <= 0:
        return start
    low, high = start, max(1.0, 2 * start)
    while objective(high) > 0:
        low, high = high, 2 * high
        if high > _EPSILON_CEILING:
            return low
    return float(brentq(objective, low, high, xtol=1e-6))


@dataclass(frozen=True)
class CanaryBound:
    """One canary audit's lower bound and what it rests on."""

    estimator: str  # "one-run" or "gdp"
    epsilon: float
    confidence: float
    delta: float
    canaries_in: int
    canaries_out: int
    thresholds: int  # thresholds scanned, the Bonferroni divisor
    threshold: float | None  # where the bound was reached (None: no bound)
    guesses: int | None = None  # one-run: canaries called "in" at that threshold
    correct: int | None = None  # one-run: of which included
    mu: float | None = None  # gdp: the mu lower bound

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _frontier(in_scores: np.ndarray, out_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thresholds on the upper convex hull of the empirical ROC, with the false negatives and true negatives at each
    (a canary is called "in" when its score >= threshold; the last threshold is +inf, calling none "in")."""
    thresholds = np.concatenate((np.union1d(in_scores, out_scores), [np.inf]))
    fn = np.searchsorted(np.sort(in_scores), thresholds, side="left")
    tn = np.searchsorted(np.sort(out_scores), thresholds, side="left")
    points = np.stack([fn, tn], axis=1).astype(float)
    keep = np.arange(len(points))
    while len(keep) > 2:  # drop every vertex its neighbours weakly dominate, until none is
        step = np.diff(points[keep], axis=0)
        dominated = step[:-1, 1] * step[1:, 0] - step[1:, 1] * step[:-1, 0] <= 0
        if not dominated.any():
            break
        keep = keep[np.r_[True, ~dominated, True]]
    return thresholds[keep], fn[keep], tn[keep]


def _upper(successes: np.ndarray, trials: int, level: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bounds at failure probability ``level`` (1 where every trial succeeded)."""
    successes = np.asarray(successes)
    with np.errstate(all="ignore"):
        return np.where(successes < trials, beta.ppf(1 - level, successes + 1, trials - successes), 1.0)


class EstimatorError(UserError):
    """Scores or settings an estimator cannot use (one sentence)."""


def _scores(in_scores: np.ndarray, out_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The scores as float arrays (lists, pandas or torch's CPU tensors too), refused unless non-empty, 1-D, finite."""
    try:
        in_scores, out_scores = (np.asarray(as_array(s), float) for s in (in_scores, out_scores))
    except (TypeError, ValueError) as exc:
        raise EstimatorError(f"The scores must be numbers ({exc}).") from None
    if in_scores.ndim != 1 or out_scores.ndim != 1 or not len(in_scores) or not len(out_scores):
        raise EstimatorError("Need non-empty 1-D scores of included and of excluded canaries.")
    if not (np.isfinite(in_scores).all() and np.isfinite(out_scores).all()):
        raise EstimatorError("Every score must be finite: a NaN or infinite score ranks nowhere; drop or clip it.")
    return in_scores, out_scores


def epsilon_one_run(
    in_scores: np.ndarray,
    out_scores: np.ndarray,
    *,
    delta: float,
    confidence: float = CONFIDENCE,
    threshold: float | None = None,
    corrected: bool = True,
) -> CanaryBound:
    """The one-run bound at ``threshold``, or else the largest over every hull threshold, each at confidence
    1 - (1 - ``confidence``) / thresholds (jax-privacy's default; ``corrected=False`` only to choose a threshold)."""
    check_level(delta, confidence)
    in_scores, out_scores = _scores(in_scores, out_scores)
    if threshold is not None:
        n_in, n_out = len(in_scores), len(out_scores)
        v, r = (
            int((in_scores >= threshold).sum()),
            int((in_scores >= threshold).sum() + (out_scores >= threshold).sum()),
        )
        epsilon = one_run_epsilon(n_in + n_out, r, v, delta=delta, confidence=confidence) if r else 0.0
        return CanaryBound("one-run", epsilon, confidence, delta, n_in, n_out, 1, threshold, guesses=r, correct=v)
    thresholds, fn, tn = _frontier(in_scores, out_scores)
    level = 1.0 - (1.0 - confidence) / (len(thresholds) if corrected else 1)
    n_in, n_out = len(in_scores), len(out_scores)
    tp, fp = n_in - fn, n_out - tn
    guesses = tp + fp
    precision_low = 1.0 - _upper(fp, guesses, 1.0 - level)  # try the most promising thresholds first (speed only)
    best = (0.0, -1)
    for index in np.argsort(-precision_low, kind="stable"):
        r, v = int(guesses[index]), int(tp[index])
        if r == 0 or v / r <= 1.0 / (1.0 + math.exp(-best[0])):
            continue
        epsilon = one_run_epsilon(n_in + n_out, r, v, delta=delta, confidence=level, start=best[0])
        if epsilon > best[0]:
            best = (epsilon, int(index))
    epsilon, index = best
    if index < 0:
        return CanaryBound("one-run", 0.0, confidence, delta, n_in, n_out, len(thresholds), None)
    return CanaryBound(
        "one-run",
        epsilon,
        confidence,
        delta,
        n_in,
        n_out,
        len(thresholds),
        float(thresholds[index]),
        guesses=int(guesses[index]),
        correct=int(tp[index]),
    )


def epsilon_from_gdp(
    in_scores: np.ndarray,
    out_scores: np.ndarray,
    *,
    delta: float,
    confidence: float = CONFIDENCE,
    threshold: float | None = None,
    corrected: bool = True,
) -> CanaryBound:
    """The Gaussian-DP bound: mu at ``threshold``, or else the largest mu over hull thresholds (each rate bounded at
    (1 - confidence) / (2 n), jax-privacy's method; ``corrected=False`` only to choose a threshold), then the
    epsilon of mu-GDP at ``delta``."""
    check_level(delta, confidence, positive_delta=True)
    in_scores, out_scores = _scores(in_scores, out_scores)
    if threshold is not None:
        thresholds = np.array([threshold])
        fn, tn = np.array([(in_scores < threshold).sum()]), np.array([(out_scores < threshold).sum()])
    else:
        thresholds, fn, tn = _frontier(in_scores, out_scores)
    n_in, n_out, n = len(in_scores), len(out_scores), len(thresholds)
    level = (1.0 - confidence) / (2 * n if corrected else 2)
    fnr_hi, fpr_hi = _upper(fn, n_in, level), _upper(n_out - tn, n_out, level)
    usable = np.maximum(fnr_hi, fpr_hi) < 1 - delta
    if not usable.any():
        return CanaryBound("gdp", 0.0, confidence, delta, n_in, n_out, n, None, mu=0.0)
    mus = np.where(usable, norm.isf(fpr_hi) - norm.ppf(fnr_hi), -np.inf)
    index = int(np.argmax(mus))
    mu = float(mus[index])
    if mu <= 0:
        return CanaryBound("gdp", 0.0, confidence, delta, n_in, n_out, n, None, mu=0.0)
    return CanaryBound(
        "gdp", gdp_epsilon(mu, delta), confidence, delta, n_in, n_out, n, float(thresholds[index]), mu=mu
    )


def gdp_epsilon(mu: float, delta: float) -> float:
    """Epsilon at ``delta`` of mu-Gaussian DP (Dong, Roth and Su 2022, Corollary 2.13): the root of
    Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta, in the log domain for stability, at most 100."""
    if mu <= 0:
        return 0.0

    def gap(eps: float) -> float:
        first, second = norm.logcdf(-eps / mu + mu / 2), eps + norm.logcdf(-eps / mu - mu / 2)
        if second >= first:
            return -math.inf
        return first + math.log1p(-math.exp(second - first)) - math.log(delta)

    if gap(0.0) <= 0:
        return 0.0
    if gap(_EPSILON_CEILING) >= 0:
        return _EPSILON_CEILING
    return float(brentq(gap, 0.0, _EPSILON_CEILING, xtol=1e-9))


ESTIMATORS = {"one-run": epsilon_one_run, "gdp": epsilon_from_gdp}


def split_audit(
    in_scores: np.ndarray,
    out_scores: np.ndarray,
    *,
    estimator: str,
    delta: float,
    confidence: float = CONFIDENCE,
    seed: int,
    fraction: float = 0.5,
) -> CanaryBound:
    """A bound valid by construction: the threshold is chosen on a random ``fraction`` of the in and of the out
    canaries (the best hull threshold there) and the bound computed at that one threshold on the others.

    The same split as jax-privacy's ``Split(fraction, seed)`` strategy (one generator; the in scores permuted first,
    then the out scores). Bonferroni over the hull vertices alone is what jax-privacy does by default, but the hull is
    chosen from the data, and on scores independent of inclusion it rejected in 6.4% of 3000 samples at 95%; a
    divisor over every threshold is valid but leaves the one-run bound no power once 2 m delta is near its level.
    """
    check_level(delta, confidence, positive_delta=estimator == "gdp")
    in_scores, out_scores = _scores(in_scores, out_scores)
    if min(len(in_scores), len(out_scores)) * min(fraction, 1 - fraction) < 1:
        raise EstimatorError(
            "Need at least two included and two excluded canaries: some of each choose the threshold, the others "
            "judge it."
        )
    rng = np.random.default_rng(seed)
    (in_choose, in_judge), (out_choose, out_judge) = (_partition(x, rng, fraction) for x in (in_scores, out_scores))
    method = ESTIMATORS[estimator]
    chosen = method(in_choose, out_choose, delta=delta, confidence=confidence, corrected=False).threshold
    if chosen is None or not len(in_judge) or not len(out_judge):
        return CanaryBound(estimator, 0.0, confidence, delta, len(in_judge), len(out_judge), 1, None)
    return method(in_judge, out_judge, delta=delta, confidence=confidence, threshold=chosen)


def _partition(scores: np.ndarray, rng: np.random.Generator, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    order = rng.permutation(len(scores))
    cut = int(len(scores) * fraction)
    return np.asarray(scores)[order[:cut]], np.asarray(scores)[order[cut:]]


def bound_by_guesses(
    in_scores: np.ndarray,
    out_scores: np.ndarray,
    *,
    delta: float,
    confidence: float = CONFIDENCE,
    points: int = 24,
) -> list[dict[str, float]]:
    """The one-run bound of guessing "in" for the k highest-scoring canaries, for k on a log grid up to m.

    Each point is the bound one would report had k been fixed before looking (the curve of Steinke et al.'s figures);
    taking the best point of the curve would not be valid, which is why the reported bound chooses its threshold on
    one half of the canaries and judges it on the other.
    """
    check_level(delta, confidence)
    if not len(in_scores) or not len(out_scores):
        return []
    in_scores, out_scores = _scores(in_scores, out_scores)
    scores = np.concatenate([in_scores, out_scores])
    member = np.concatenate([np.ones(len(in_scores), bool), np.zeros(len(out_scores), bool)])
    m = len(scores)
    order = np.argsort(-scores, kind="stable")
    correct = np.cumsum(member[order])
    # Guessing the k highest "in" means nothing inside a tie: k moves to the end of its tie, so that a tie is guessed
    # whole (ranked by the order given, the included canaries, listed first, were guessed first among equal scores).
    ranked = scores[order]
    ties_end = np.searchsorted(-ranked, -ranked, side="right")
    grid = np.unique(ties_end[np.geomspace(1, m, num=min(points, m)).round().astype(int) - 1])
    return [
        {
            "guesses": int(k),
            "correct": int(correct[k - 1]),
            "epsilon": one_run_epsilon(m, int(k), int(correct[k - 1]), delta=delta, confidence=confidence),
        }
        for k in grid
    ]


@dataclass(frozen=True)
class GaussianEstimate:
    """An estimate of epsilon, not a bound: the scores of included and excluded canaries fitted by two Gaussians
    with one variance (Andrew et al., ICLR 2024), mu = (mean_in - mean_out) / pooled sd, and the epsilon of mu-GDP
    at delta, with a percentile bootstrap interval (in and out canaries resampled separately)."""

    epsilon: float
    ci95: tuple[float, float]
    mu: float
    canaries_in: int
    canaries_out: int
    resamples: int
    delta: float
    rigorous: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ci95": list(self.ci95)}


def _mu(in_scores: np.ndarray, out_scores: np.ndarray) -> np.ndarray:
    """The fitted mu of each row (or of the 1-D pair); signed, so a score that separates the wrong way gives mu < 0."""
    n_in, n_out = in_scores.shape[-1], out_scores.shape[-1]
    pooled = (in_scores.var(axis=-1, ddof=1) * (n_in - 1) + out_scores.var(axis=-1, ddof=1) * (n_out - 1)) / (
        n_in + n_out - 2
    )
    gap = in_scores.mean(axis=-1) - out_scores.mean(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(pooled > 0, gap / np.sqrt(pooled), np.where(gap > 0, np.inf, 0.0))


def gaussian_estimate(
    in_scores: np.ndarray, out_scores: np.ndarray, *, delta: float, seed: int, resamples: int = 1000
) -> GaussianEstimate:
    """The two-Gaussian estimate of epsilon (see :class:`GaussianEstimate`). Only mu > 0 counts as leakage: a score
    that separates in the wrong direction estimates epsilon 0, never the epsilon of |mu|."""
    check_level(delta, CONFIDENCE, positive_delta=True)
    if not isinstance(resamples, numbers.Integral) or isinstance(resamples, bool) or resamples < 1:
        raise EstimatorError(f"resamples must be a positive integer, got {resamples!r}.")
    in_scores, out_scores = _scores(in_scores, out_scores)
    if len(in_scores) < 2 or len(out_scores) < 2:
        raise EstimatorError("The two-Gaussian estimate needs at least two included and two excluded canaries.")
    rng = np.random.default_rng(seed)
    mu = float(_mu(in_scores, out_scores))
    boot_in = in_scores[rng.integers(0, len(in_scores), (resamples, int(len(in_scores))))]
    boot_out = out_scores[rng.integers(0, len(out_scores), (resamples, int(len(out_scores))))]
    # an infinite mu (no spread within either side) is as far as gdp_epsilon's ceiling: percentiles of infinities
    # would be NaN, and the interval (0, 0) beside an estimate of 100
    low, high = np.percentile(np.minimum(_mu(boot_in, boot_out), 1e6), [2.5, 97.5])

    def epsilon(m: float) -> float:
        return gdp_epsilon(float(min(m, 1e6)), delta) if m > 0 else 0.0

    return GaussianEstimate(
        epsilon(mu), (epsilon(low), epsilon(high)), mu, len(in_scores), len(out_scores), int(resamples), delta
    )

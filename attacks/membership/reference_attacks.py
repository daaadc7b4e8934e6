"""RMIA and LiRA: membership scores that compare a record's signal on the target model with its signal on reference
models (attacks/membership/references.py). Pure numpy; higher scores mean "more likely a member".

- **LiRA** (Carlini et al., S&P 2022), on the logit-scaled confidence phi = log p_y / (1 - p_y) (or another signal).
  Offline: a Gaussian N(mu_out(x), sigma_out^2) fitted to the references that did not train on x, with one variance
  for all records (fixed variance), and the paper's one-sided test: score = log Pr[Z <= phi_target(x)]. Online:
  score = log N(phi; mu_in(x), sigma_in^2) - log N(phi; mu_out(x), sigma_out^2), both variances fixed.
- **RMIA** (Zarifzadeh et al., ICML 2024), on the probability of the true label p(x|theta). The likelihood ratio of
  x against a population record z is LR(x, z) = (p(x|theta) / p(x)) / (p(z|theta) / p(z)), with p(x) the mean of
  p(x|theta') over the reference models, and the score is the fraction of population records z with
  LR(x, z) >= gamma. Offline, only references without x exist, and p(x) is approximated from their mean p_out(x)
  as p(x) = ((1 + a) p_out(x) + (1 - a)) / 2 (the paper's linear fit, parameter a). The z-term p(z|theta) / p(z)
  is what a score that divides by p(x) alone (as Privacy Meter's simplified offline RMIA does) leaves out.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import norm

from fedaudit.attacks.metrics import auc_score

_TINY = 1e-30


def _masked_mean(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Column means of ``values`` [K, n] over the rows where ``mask`` is true (NaN where none is)."""
    counts = mask.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, (values * mask).sum(axis=0) / counts, np.nan)


def _pooled_std(values: np.ndarray, mask: np.ndarray, means: np.ndarray) -> float:
    """One standard deviation for all records (the paper's fixed variance): the residuals of every masked entry from
    its column's mean, over their degrees of freedom (each record's count less one). Where no record has two masked
    entries (one reference offline, two online) that within-record spread cannot be estimated (it was 0, and every
    score 0 or -1e60): then the spread of all masked entries about their common mean, as Carlini et al.'s code
    computes its global variance."""
    valid = mask & np.isfinite(means)[None, :]
    freedom = int(np.maximum(valid.sum(axis=0) - 1, 0).sum())
    if freedom > 0:
        residuals = (values - means)[valid]
        return float(np.sqrt(np.sum(residuals**2) / freedom))
    entries = values[valid]
    return float(np.std(entries)) if entries.size > 1 else 0.0


def lira_scores(target: np.ndarray, refs: np.ndarray, refs_in: np.ndarray | None = None) -> np.ndarray:
    """LiRA scores of n records: ``target`` [n] the signal on the target model, ``refs`` [K, n] on the references,
    ``refs_in`` [K, n] whether each reference trained on each record (None: offline, no reference did)."""
    target, refs = np.asarray(target, float), np.asarray(refs, float)
    out = np.ones(refs.shape, bool) if refs_in is None else ~np.asarray(refs_in, bool)
    mu_out = _masked_mean(refs, out)
    sigma_out = max(_pooled_std(refs, out, mu_out), _TINY)
    if refs_in is None:
        return norm.logcdf(target, mu_out, sigma_out)
    inside = np.asarray(refs_in, bool)
    mu_in = _masked_mean(refs, inside)
    sigma_in = max(_pooled_std(refs, inside, mu_in), _TINY)
    return norm.logpdf(target, mu_in, sigma_in) - norm.logpdf(target, mu_out, sigma_out)


def rmia_marginal(refs: np.ndarray, out: np.ndarray | None, a: float, *, online: bool = False) -> np.ndarray:
    """p(x) of n records from ``refs`` [K, n] (probabilities of the true label): the mean over every reference
    online; offline ((1 + a) p_out + (1 - a)) / 2 with p_out the mean over the references where ``out`` [K, n] is
    true (all of them when None), NaN for a record without any."""
    refs = np.asarray(refs, float)
    if online:
        return refs.mean(axis=0)
    mask = np.ones(refs.shape, bool) if out is None else np.asarray(out, bool)
    return 0.5 * ((1.0 + a) * _masked_mean(refs, mask) + (1.0 - a))


def rmia_scores(
    target_x: np.ndarray,
    refs_x: np.ndarray,
    target_z: np.ndarray,
    refs_z: np.ndarray,
    *,
    a: float = 0.3,
    gamma: float = 1.0,
    online: bool = False,
    x_out: np.ndarray | None = None,
    z_out: np.ndarray | None = None,
) -> np.ndarray:
    """RMIA scores of n records against m population records: the fraction of z with LR(x, z) >= ``gamma``.

    ``target_x`` [n] and ``target_z`` [m]: p(.|theta) on the target; ``refs_x`` [K, n] and ``refs_z`` [K, m] on the
    references; ``x_out`` and ``z_out`` [K, .]: which references did not train on each record (None: none did).
    p(x) and p(z) are computed alike (:func:`rmia_marginal`); offline, a population record that every reference
    trained on has no p(z) and is left out.
    """
    px = rmia_marginal(refs_x, x_out, a, online=online)
    pz = rmia_marginal(refs_z, z_out, a, online=online)
    ratio_x = np.asarray(target_x, float) / np.maximum(px, _TINY)
    ratio_z = np.asarray(target_z, float) / np.maximum(pz, _TINY)
    ratio_z = ratio_z[np.isfinite(ratio_z)]
    if not ratio_z.size:
        raise ValueError("RMIA needs at least one population record with a reference that did not train on it.")
    # LR(x, z) >= gamma  <=>  ratio_x >= gamma * ratio_z; count over z with a sorted search
    thresholds = np.sort(gamma * ratio_z)
    return np.searchsorted(thresholds, ratio_x, side="right") / len(thresholds)


A_GRID = tuple(round(0.1 * i, 1) for i in range(11))


def tune_a(refs_z: np.ndarray, z_in: np.ndarray, *, gamma: float = 1.0) -> float | None:
    """The offline parameter a, as Privacy Meter tunes it: attack reference 0 with the others on the population
    records (members: those reference 0 trained on) and keep the a of the grid 0, 0.1, .., 1 with the highest AUC
    (the first on ties). None with fewer than two references or a degenerate population."""
    refs_z, z_in = np.asarray(refs_z, float), np.asarray(z_in, bool)
    if len(refs_z) < 2:
        return None
    out = ~z_in[1:]
    usable = out.any(axis=0)
    member = z_in[0][usable]
    if member.all() or not member.any():
        return None
    best, best_auc = None, -1.0
    for a in A_GRID:
        scores = rmia_scores(
            refs_z[0][usable], refs_z[1:, usable], refs_z[0][usable], refs_z[1:, usable], a=a, gamma=gamma,
            x_out=out[:, usable], z_out=out[:, usable],
        )  # fmt: skip
        auc = auc_score(member, scores)
        if auc > best_auc:
            best, best_auc = a, auc
    return best

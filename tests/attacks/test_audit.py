"""Canary audit estimators against the paper's reference code, closed forms, an independent accountant, and nulls."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from scipy.optimize import brentq

from fedaudit.attacks.audit import (
    audit_gdp,
    audit_one_run,
    gdp_epsilon,
    one_run_epsilon,
    one_run_p_value,
)

DELTA = 1e-5


def reference_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Steinke, Nasr and Jagielski 2023's reference code, as printed in the paper (an obviously correct loop)."""
    q = 1 / (1 + math.exp(-eps))
    beta = scipy.stats.binom.sf(v - 1, r, q)
    alpha = 0
    total = 0
    for i in range(1, v + 1):
        total = total + scipy.stats.binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1)


def reference_epsilon(m: int, r: int, v: int, delta: float, p: float) -> float:
    eps_min, eps_max = 0.0, 1.0
    while reference_p_value(m, r, v, eps_max, delta) < p:
        eps_max = eps_max + 1
    for _ in range(30):
        eps = (eps_min + eps_max) / 2
        if reference_p_value(m, r, v, eps, delta) < p:
            eps_min = eps
        else:
            eps_max = eps
    return eps_min


@pytest.mark.parametrize(
    "m, r, v, eps, delta",
    [
        (1000, 100, 90, 1.0, 1e-5),
        (1000, 100, 90, 2.5, 1e-5),
        (50, 50, 30, 0.3, 1e-3),
        (10_000, 400, 399, 4.0, 1e-6),
        (200, 20, 0, 1.0, 1e-5),
        (200, 20, 20, 0.0, 0.0),
    ],
)
def test_p_value_matches_the_papers_reference_code(m, r, v, eps, delta):
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(reference_p_value(m, r, v, eps, delta), rel=1e-9)


@pytest.mark.parametrize("m, r, v", [(1000, 100, 90), (1000, 1000, 600), (100, 10, 10), (5000, 500, 420)])
def test_epsilon_matches_the_papers_reference_code(m, r, v):
    assert one_run_epsilon(m, r, v, delta=DELTA) == pytest.approx(reference_epsilon(m, r, v, DELTA, 0.05), abs=1e-7)


def test_without_delta_the_bound_is_the_binomial_tail_inverted():
    """delta = 0: the largest eps with P[Binomial(r, e^eps/(1+e^eps)) >= v] < 5%, found by root finding instead."""
    m, r, v = 1000, 200, 160
    exact = brentq(lambda e: scipy.stats.binom.sf(v - 1, r, 1 / (1 + math.exp(-e))) - 0.05, 0.0, 10.0, xtol=1e-12)
    assert one_run_epsilon(m, r, v, delta=0.0) == pytest.approx(exact, abs=1e-7)
    assert one_run_epsilon(m, r, r // 2, delta=0.0) == 0.0  # chance-level guesses reject nothing


def randomised_response_canaries(eps: float, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each canary's score is its inclusion bit, flipped with probability 1 / (1 + e^eps) (exactly eps-DP per canary),
    plus a tiny tie-breaking jitter."""
    rng = np.random.default_rng(seed)
    included = rng.integers(0, 2, m)
    keep = rng.random(m) < 1 / (1 + math.exp(-eps))
    return np.where(keep, included, 1 - included) + 1e-6 * rng.random(m), included


def test_one_run_bound_on_randomised_response_stays_below_the_truth_and_comes_close():
    bounds = [audit_one_run(*randomised_response_canaries(2.0, 4000, seed), delta=0.0).epsilon for seed in range(60)]
    assert sum(b > 2.0 for b in bounds) <= 3  # valid at 95%: above the truth in at most ~5% of runs
    assert np.median(bounds) > 1.6  # and not far from eps = 2 with 4000 canaries


def test_scores_independent_of_inclusion_rarely_give_a_positive_bound():
    positive_one_run, positive_gdp = 0, 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        included, scores = rng.integers(0, 2, 500), rng.normal(size=500)
        positive_one_run += audit_one_run(scores, included, delta=DELTA).epsilon > 0
        positive_gdp += audit_gdp(scores, included, rng.random(500) < 0.5, delta=DELTA).epsilon > 0
    assert positive_one_run <= 10 and positive_gdp <= 10  # at most 5% of 200 at 95% confidence


def test_gdp_epsilon_equals_an_independent_accountant_for_the_gaussian_mechanism():
    """mu-GDP is the Gaussian mechanism with sensitivity 1 and sigma = 1 / mu; dp-accounting's PLD accountant is
    tight for it (up to its discretisation)."""
    dp_accounting = pytest.importorskip("dp_accounting")
    for mu in (0.5, 1.0, 2.0):
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier=1 / mu))
        assert gdp_epsilon(mu, DELTA) == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-6)


def gaussian_canaries(mu: float, m: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    included = rng.integers(0, 2, m)
    return rng.normal(mu * included, 1.0), included, rng.random(m) < 0.5


def test_gdp_bound_of_gaussian_canaries_stays_below_the_truth_and_approaches_it():
    truth = gdp_epsilon(1.0, DELTA)
    bounds = [
        audit_gdp(*gaussian_canaries(1.0, 2000, seed)[:2], gaussian_canaries(1.0, 2000, seed)[2], delta=DELTA).epsilon
        for seed in range(60)
    ]
    assert sum(b > truth for b in bounds) <= 3
    scores, included, choose = gaussian_canaries(1.0, 40_000, 0)
    assert audit_gdp(scores, included, choose, delta=DELTA).epsilon > 0.6 * truth


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        one_run_p_value(10, 20, 5, 1.0, DELTA)
    with pytest.raises(ValueError):
        audit_one_run(np.zeros(3), np.zeros(2, dtype=int), delta=DELTA)

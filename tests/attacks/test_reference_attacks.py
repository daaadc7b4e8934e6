"""RMIA and LiRA scores: slow, obviously correct loops, a Gaussian case whose optimal test is known in closed form,
and Privacy Meter's offline RMIA formula transcribed as a reference."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.metrics import roc_auc_score

from fedaudit.attacks.membership.reference_attacks import lira_scores, rmia_marginal, rmia_scores, tune_a


def slow_rmia(target_x, refs_x, target_z, refs_z, *, a, gamma, online, x_out=None, z_out=None):
    """One record and one population record at a time, straight from the definitions."""
    k, n = refs_x.shape
    m = refs_z.shape[1]

    def marginal(refs, out, j):
        if online:
            return sum(refs[r, j] for r in range(k)) / k
        chosen = [refs[r, j] for r in range(k) if out is None or out[r, j]]
        if not chosen:
            return None
        return ((1 + a) * sum(chosen) / len(chosen) + (1 - a)) / 2

    ratios_z = []
    for j in range(m):
        pz = marginal(refs_z, z_out, j)
        if pz is not None:
            ratios_z.append(target_z[j] / pz)
    scores = []
    for i in range(n):
        ratio_x = target_x[i] / marginal(refs_x, x_out, i)
        scores.append(sum(1 for rz in ratios_z if ratio_x / rz >= gamma) / len(ratios_z))
    return np.array(scores)


def slow_lira(target, refs, refs_in=None):
    k, n = refs.shape
    inside = np.zeros((k, n), bool) if refs_in is None else refs_in
    out_means = [np.mean([refs[r, i] for r in range(k) if not inside[r, i]]) for i in range(n)]
    out_res = [refs[r, i] - out_means[i] for i in range(n) for r in range(k) if not inside[r, i]]
    sigma_out = np.sqrt(np.sum(np.square(out_res)) / (len(out_res) - n))  # n means estimated
    if refs_in is None:
        return np.array([norm.logcdf(target[i], out_means[i], sigma_out) for i in range(n)])
    in_means = [np.mean([refs[r, i] for r in range(k) if inside[r, i]]) for i in range(n)]
    in_res = [refs[r, i] - in_means[i] for i in range(n) for r in range(k) if inside[r, i]]
    sigma_in = np.sqrt(np.sum(np.square(in_res)) / (len(in_res) - n))
    return np.array(
        [
            norm.logpdf(target[i], in_means[i], sigma_in) - norm.logpdf(target[i], out_means[i], sigma_out)
            for i in range(n)
        ]
    )


@pytest.mark.parametrize("online", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 2.0])
def test_rmia_equals_the_slow_loop(online, gamma):
    rng = np.random.default_rng(0)
    k, n, m = 4, 30, 50
    refs_x, refs_z = rng.uniform(0.01, 1, (k, n)), rng.uniform(0.01, 1, (k, m))
    target_x, target_z = rng.uniform(0.01, 1, n), rng.uniform(0.01, 1, m)
    z_out = rng.random((k, m)) < 0.5
    z_out[:, 0] = False  # a population record every reference trained on: left out offline
    fast = rmia_scores(target_x, refs_x, target_z, refs_z, a=0.4, gamma=gamma, online=online, z_out=z_out)
    slow = slow_rmia(target_x, refs_x, target_z, refs_z, a=0.4, gamma=gamma, online=online, z_out=z_out)
    np.testing.assert_allclose(fast, slow)


@pytest.mark.parametrize("online", [False, True])
def test_lira_equals_the_slow_loop(online):
    rng = np.random.default_rng(1)
    k, n = 8, 40
    refs, target = rng.normal(size=(k, n)), rng.normal(size=n)
    refs_in = np.argsort(rng.random((k, n)), axis=0) < k // 2 if online else None
    np.testing.assert_allclose(lira_scores(target, refs, refs_in), slow_lira(target, refs, refs_in))


@pytest.mark.parametrize("online", [False, True])
def test_lira_with_one_value_per_record_uses_the_spread_of_all_of_them(online):
    """One reference offline (two online: one in, one out per record) leaves no within-record spread to estimate:
    the fixed variance is then that of all the references' values (it was 0, every score 0 or about -1e60), and the
    scores rank as (target - mean) / sigma does."""
    rng = np.random.default_rng(3)
    n = 200
    difficulty = rng.normal(0, 2, n)
    member = np.arange(n) < n // 2
    target = difficulty + member + rng.normal(size=n)
    if online:
        refs_in = np.zeros((2, n), bool)
        refs_in[rng.integers(0, 2, n), np.arange(n)] = True
        refs = difficulty + refs_in + rng.normal(size=(2, n))
        out_values, in_values = refs[~refs_in], refs[refs_in]
        scores = lira_scores(target, refs, refs_in)
        mu_in = np.where(refs_in[0], refs[0], refs[1])
        mu_out = np.where(refs_in[0], refs[1], refs[0])
        expected = norm.logpdf(target, mu_in, np.std(in_values)) - norm.logpdf(target, mu_out, np.std(out_values))
    else:
        refs_in = None
        refs = (difficulty + rng.normal(size=n))[None, :]
        scores = lira_scores(target, refs)
        expected = norm.logcdf(target, refs[0], np.std(refs))
    np.testing.assert_allclose(scores, expected)
    assert np.isfinite(scores).all() and np.abs(scores).max() < 1e3


def test_lira_reaches_the_optimal_test_of_a_gaussian_shift_and_a_global_threshold_does_not():
    """phi_i = d_i + mu * member + N(0, 1) with a per-record difficulty d_i ~ N(0, 4): the Neyman-Pearson test knows
    d_i and has AUC Phi(mu / sqrt 2); a global threshold on phi sees d_i as noise, AUC Phi(mu / sqrt(2 (1 + 4)))."""
    rng = np.random.default_rng(2)
    n, k, mu = 20000, 64, 1.0
    difficulty = rng.normal(0, 2, n)
    member = np.arange(n) < n // 2
    target = difficulty + mu * member + rng.normal(size=n)
    refs = difficulty + rng.normal(size=(k, n))  # offline: no reference trained on any audited record
    optimal, threshold = norm.cdf(mu / np.sqrt(2)), norm.cdf(mu / np.sqrt(2 * 5))
    assert roc_auc_score(member, lira_scores(target, refs)) == pytest.approx(optimal, abs=0.015)
    assert roc_auc_score(member, target) == pytest.approx(threshold, abs=0.015)
    refs_in = np.argsort(rng.random((k, n)), axis=0) < k // 2  # online: each record in half of the references
    refs_online = difficulty + mu * refs_in + rng.normal(size=(k, n))
    assert roc_auc_score(member, lira_scores(target, refs_online, refs_in)) == pytest.approx(optimal, abs=0.015)


def test_rmia_recovers_the_per_record_calibration_that_a_threshold_misses():
    """p(x|theta) = sigmoid(phi) with phi as above: RMIA, which divides by p(x) from the references, ranks close to
    the optimal test; a threshold on p(x|theta) alone does not."""
    rng = np.random.default_rng(3)
    n, m, k, mu = 20000, 1000, 32, 1.0

    def sigmoid(v):
        return 1 / (1 + np.exp(-v))

    difficulty, z_difficulty = rng.normal(0, 2, n), rng.normal(0, 2, m)
    member = np.arange(n) < n // 2
    target_x = sigmoid(difficulty + mu * member + rng.normal(size=n))
    refs_x = sigmoid(difficulty + rng.normal(size=(k, n)))
    target_z = sigmoid(z_difficulty + rng.normal(size=m))
    refs_z = sigmoid(z_difficulty + rng.normal(size=(k, m)))
    auc = roc_auc_score(member, rmia_scores(target_x, refs_x, target_z, refs_z, a=1.0))
    assert auc > roc_auc_score(member, target_x) + 0.07
    assert auc > norm.cdf(mu / np.sqrt(2)) - 0.06


def privacy_meter_offline_rmia(target_x, refs_x, target_z, refs_z, a):
    """Privacy Meter's offline RMIA score as its attacks.py (run_rmia, commit e384af8 of
    privacytrustlab/ml_privacy_meter, MIT License, (c) 2020 Data Privacy and Trustworthy Machine Learning Research Lab)
    computes it, transcribed: refs_x [K, n] are the OUT references of each x; refs_z [K, m] the references of z."""
    mean_out_x = np.mean(refs_x.T, axis=1)
    mean_x = (1 + a) / 2 * mean_out_x + (1 - a) / 2
    prob_ratio_x = target_x.ravel() / mean_x
    z_out_signals = -np.sort(-refs_z.T, axis=1)[:, : refs_x.shape[0]]
    mean_out_z = np.mean(z_out_signals, axis=1)
    mean_z = (1 + a) / 2 * mean_out_z + (1 - a) / 2
    prob_ratio_z = target_z.ravel() / mean_z
    ratios = prob_ratio_x[:, np.newaxis] / prob_ratio_z
    return np.average(ratios > 1.0, axis=1)


@pytest.mark.parametrize("a", [0.0, 0.3, 1.0])
def test_offline_rmia_equals_privacy_meters_formula(a):
    """Same p(x) approximation, same ratio, same comparison with the population (continuous scores: > and >= agree).
    Privacy Meter averages the K largest reference values of each z; given K references of z, that is their mean."""
    rng = np.random.default_rng(4)
    k, n, m = 3, 200, 300
    refs_x, refs_z = rng.uniform(0.01, 1, (k, n)), rng.uniform(0.01, 1, (k, m))
    target_x, target_z = rng.uniform(0.01, 1, n), rng.uniform(0.01, 1, m)
    ours = rmia_scores(target_x, refs_x, target_z, refs_z, a=a)
    np.testing.assert_array_equal(ours, privacy_meter_offline_rmia(target_x, refs_x, target_z, refs_z, a))
    np.testing.assert_allclose(rmia_marginal(refs_x, None, a), (1 + a) / 2 * refs_x.mean(axis=0) + (1 - a) / 2)


def test_a_is_tuned_on_the_references_and_picks_the_best_auc():
    rng = np.random.default_rng(5)
    k, m = 6, 600
    z_in = rng.random((k, m)) < 0.5
    difficulty = rng.normal(0, 2, m)
    refs_z = 1 / (1 + np.exp(-(difficulty + 1.5 * z_in + rng.normal(size=(k, m)))))
    chosen = tune_a(refs_z, z_in)
    out = ~z_in[1:]
    aucs = {
        a: roc_auc_score(z_in[0], rmia_scores(refs_z[0], refs_z[1:], refs_z[0], refs_z[1:], a=a, x_out=out, z_out=out))
        for a in [round(0.1 * i, 1) for i in range(11)]
    }
    assert chosen == max(aucs, key=lambda a: (aucs[a], -a))
    assert tune_a(refs_z[:1], z_in[:1]) is None


@pytest.mark.parametrize("method", ["rmia", "lira-offline", "lira-online"])
def test_scores_independent_of_membership_look_like_chance_over_200_seeds(method):
    """The null side: the target's signals carry no membership, so the AUC is outside its 95% null interval
    (Mann-Whitney, 0.5 +- 1.96 sqrt((n1 + n2 + 1) / (12 n1 n2))) in about 5% of seeds, never far more."""
    n, m, k = 200, 300, 4
    half = 1.96 * np.sqrt((n + n + 1) / (12 * n * n))
    outside = 0
    for seed in range(200):
        rng = np.random.default_rng(1000 + seed)
        member = np.r_[np.ones(n), np.zeros(n)]
        difficulty = rng.normal(0, 2, 2 * n)
        refs = difficulty + rng.normal(size=(k, 2 * n))
        target = difficulty + rng.normal(size=2 * n)
        if method == "rmia":
            z_difficulty = rng.normal(0, 2, m)

            def p(v):
                return 1 / (1 + np.exp(-v))

            scores = rmia_scores(
                p(target), p(refs), p(z_difficulty + rng.normal(size=m)), p(z_difficulty + rng.normal(size=(k, m))),
                a=0.3,
            )  # fmt: skip
        elif method == "lira-offline":
            scores = lira_scores(target, refs)
        else:
            refs_in = np.argsort(rng.random((k, 2 * n)), axis=0) < k // 2
            scores = lira_scores(target, refs, refs_in)
        outside += abs(roc_auc_score(member, scores) - 0.5) > half
    assert outside <= 20  # 10% of 200: the expected 10 plus a wide margin for a binomial count

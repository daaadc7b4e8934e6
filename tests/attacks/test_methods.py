"""Attack methods: threshold, classifier and population."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.metrics import roc_auc_score

from fedaudit.attacks.membership.methods import FPR_TOLERANCES, classifier_attack, population_attack, run_method
from fedaudit.attacks.membership.signals import oriented


def labels(n_members: int, n_nonmembers: int) -> np.ndarray:
    return np.concatenate([np.ones(n_members, dtype=int), np.zeros(n_nonmembers, dtype=int)])


# ---------------------------------------------------------------------------- methods


def test_threshold_reports_on_every_record() -> None:
    member = labels(50, 50)
    values = np.concatenate([np.full(50, 0.1), np.full(50, 1.0)])  # members: low loss
    out = run_method("threshold", values, oriented("loss", values), member, np.zeros(100, dtype=bool), seed=0)
    assert out.audit.all()
    assert roc_auc_score(member, out.scores) == 1.0


def test_classifier_fits_on_attack_train_and_finds_non_monotone_leakage() -> None:
    rng = np.random.default_rng(6)
    n = 600
    member = labels(n, n)
    # members sit in a band, non-members on both sides of it: no single threshold separates them
    values = np.concatenate([rng.normal(0, 0.3, n), rng.choice([-2.0, 2.0], n) + rng.normal(0, 0.3, n)])
    attack_train = rng.random(2 * n) < 0.5
    out = classifier_attack(values, values, member, attack_train, seed=0)
    np.testing.assert_array_equal(out.audit, ~attack_train)
    audited = roc_auc_score(member[out.audit], out.scores[out.audit])
    assert audited > 0.95
    assert abs(roc_auc_score(member, values) - 0.5) < 0.1  # the threshold attack sees nothing
    assert out.details["classifier"]["training_records"] == int(attack_train.sum())


def test_population_thresholds_hold_the_false_positive_tolerance() -> None:
    rng = np.random.default_rng(7)
    n = 20000
    member = labels(n, n)
    score = np.concatenate([rng.normal(1, 1, n), rng.normal(0, 1, n)])
    attack_train = rng.random(2 * n) < 0.5
    out = population_attack(score, score, member, attack_train)
    rows = out.details["population"]
    assert [r["fpr_tolerance"] for r in rows] == list(FPR_TOLERANCES)
    reference = score[attack_train & (member == 0)]
    for row in rows:
        alpha = row["fpr_tolerance"]
        assert np.mean(reference > row["threshold"]) <= alpha  # by construction on the reference
        assert row["fpr"] == pytest.approx(alpha, abs=4 * math.sqrt(alpha * (1 - alpha) / (n / 2)) + 1e-3)
        assert row["tpr"] == pytest.approx(norm.sf(row["threshold"] - 1), abs=0.02)  # N(1, 1) above the threshold
        assert row["num_members"] == int((~attack_train & (member == 1)).sum())
        for rate, key in (("tpr", "ci95"), ("fpr", "fpr_ci95")):
            low, high = row[key]
            assert low <= row[rate] <= high
    np.testing.assert_array_equal(out.audit, ~attack_train)

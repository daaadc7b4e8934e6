"""Metrics against closed forms, exact binomial intervals and slow loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import binomtest, norm
from sklearn.metrics import roc_auc_score, roc_curve

from fedaudit.attacks.metrics import (
    Bootstrap,
    auc_score,
    bootstrap,
    bootstrap_groups,
    clopper_pearson_lower,
    clopper_pearson_upper,
    difference_interval,
    epsilon_lower_bound,
    held_out_advantage,
    rate_interval,
    rates_at_fpr,
    resample_counts,
    roc,
    summarize,
    threshold_bounds,
    weighted_auc,
)

DELTA = 1e-5


def labels(n_members: int, n_nonmembers: int) -> np.ndarray:
    return np.concatenate([np.ones(n_members, dtype=int), np.zeros(n_nonmembers, dtype=int)])


def randomised_response(eps: float, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Members answer 1 with probability e^eps / (1 + e^eps), non-members with 1 / (1 + e^eps): exactly eps-DP."""
    rng = np.random.default_rng(seed)
    p = math.exp(eps) / (1.0 + math.exp(eps))
    scores = np.concatenate([rng.random(n) < p, rng.random(n) < 1.0 - p]).astype(float)
    return labels(n, n), scores


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The (eps, delta) curve of N(0, 1) vs N(mu, 1): delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0.0, 60.0)


# ---------------------------------------------------------------------------- metrics


def halves(n_members: int, n_nonmembers: int, seed: int = 0) -> np.ndarray:
    """A random half of each side, as the evaluation set's attack-training half."""
    rng = np.random.default_rng(seed)
    return np.concatenate(
        [rng.permutation(n_members) < n_members // 2, rng.permutation(n_nonmembers) < n_nonmembers // 2]
    )


def bound(member: np.ndarray, score: np.ndarray, delta: float = DELTA, seed: int = 0) -> float:
    n1, n0 = int(member.sum()), int((member == 0).sum())
    return epsilon_lower_bound(member, score, halves(n1, n0, seed), delta=delta).epsilon


def test_perfectly_separated_scores() -> None:
    member = labels(1500, 1500)
    score = np.concatenate([np.linspace(2, 3, 1500), np.linspace(0, 1, 1500)])
    everyone = np.ones(3000, dtype=bool)
    metrics, curve = summarize(
        member,
        score,
        report=everyone,
        select=halves(1500, 1500),
        delta=DELTA,
        rng=np.random.default_rng(0),
        resamples=200,
    )
    assert metrics["auc"] == 1.0
    assert metrics["auc_ci95"] == [1.0, 1.0]
    # TPR at 1% FPR: threshold from the choosing half's 750 non-members, measured on the other 750 of each side
    entry = metrics["tpr_at_fpr"]["0.01"]
    assert entry["estimable"] and entry["tpr"] == 1.0
    assert entry["fpr"] == pytest.approx(0.01, abs=0.006) and entry["fpr_ci95"][0] < 0.01 < entry["fpr_ci95"][1]
    assert entry["ci95"] == pytest.approx([0.025 ** (1 / 750), 1.0])  # two-sided Clopper-Pearson, every hit
    assert entry["num_members"] == entry["num_nonmembers"] == entry["num_reference_nonmembers"] == 750
    assert not metrics["tpr_at_fpr"]["0.001"]["estimable"]  # 750 non-members per half cannot resolve 0.1%
    assert metrics["advantage"] == 1.0 and metrics["balanced_accuracy"] == 1.0
    held_out = metrics["advantage_held_out"]
    assert held_out["advantage"] == 1.0 and held_out["ci95"][1] == pytest.approx(1.0) and held_out["ci95"][0] > 0.99
    # No error at all: the bound is limited by the 750 records per side it is judged on. The chosen test has
    # TP = 750 and FP = 0 there, whose one-sided Clopper-Pearson bounds, each at 97.5% so that both hold at 95%,
    # are 0.025^(1/750) and 1 - 0.025^(1/750).
    a = 0.025 ** (1 / 750)
    assert metrics["epsilon_lower_bound"] == pytest.approx(math.log((a - DELTA) / (1 - a)))
    test = metrics["epsilon_lower_bound_test"]
    assert (test["bound_members"], test["bound_nonmembers"], test["selection_members"]) == (750, 750, 750)
    assert (test["true_positives"], test["false_positives"]) == (750, 0)


def test_identically_distributed_scores() -> None:
    rng = np.random.default_rng(1)
    member, score = labels(2000, 2000), rng.normal(size=4000)
    metrics, _ = summarize(
        member, score, report=np.ones(4000, dtype=bool), select=halves(2000, 2000), delta=DELTA, rng=rng
    )
    low, high = metrics["auc_ci95"]
    assert low < 0.5 < high
    assert high - low < 0.08  # 2000 per side: a tight interval
    assert metrics["epsilon_lower_bound"] == 0.0
    assert metrics["advantage"] < 0.1
    assert metrics["advantage_held_out"]["ci95"][0] < 0 < metrics["advantage_held_out"]["ci95"][1]


def test_tpr_below_the_sample_s_resolution_is_not_estimable() -> None:
    """253 non-members (126 and 127 per half) cannot show an FPR of 0.1%: say so, and what it needs."""
    rng = np.random.default_rng(5)
    member, score = labels(253, 253), rng.normal(size=506) + 0.5 * labels(253, 253)
    metrics, _ = summarize(
        member, score, report=np.ones(506, dtype=bool), select=halves(253, 253), delta=DELTA, rng=rng, resamples=50
    )
    at_1pct, at_01pct = metrics["tpr_at_fpr"]["0.01"], metrics["tpr_at_fpr"]["0.001"]
    assert at_1pct["estimable"] and at_1pct["num_nonmembers"] == 127 and at_1pct["nonmembers_needed"] == 100
    for rate in ("tpr", "fpr"):
        low, high = at_1pct[f"{rate}_ci95" if rate == "fpr" else "ci95"]
        assert low <= at_1pct[rate] <= high
    assert at_01pct == {
        "target_fpr": 0.001,
        "num_members": 127,
        "num_nonmembers": 127,
        "num_reference_nonmembers": 126,
        "nonmembers_needed": 1000,
        "estimable": False,
        "reason": "126 non-members per half cannot resolve an FPR of 0.001 (needs 1000)",
        "threshold": None,
        "tpr": None,
        "ci95": None,
        "fpr": None,
        "fpr_ci95": None,
    }


def test_bootstrap_interval_matches_a_naive_bootstrap() -> None:
    rng = np.random.default_rng(2)
    member = labels(300, 300)
    score = np.round(rng.normal(size=600) + 0.4 * member, 1)  # rounded: many ties
    low, high = Bootstrap.interval(bootstrap(member, score, rng=np.random.default_rng(3), resamples=2000).auc)
    naive = []
    pos, neg = score[member == 1], score[member == 0]
    for _ in range(500):
        p, n = rng.choice(pos, pos.size), rng.choice(neg, neg.size)
        naive.append(roc_auc_score(labels(p.size, n.size), np.concatenate([p, n])))
    ref_low, ref_high = np.quantile(naive, [0.025, 0.975])
    assert low == pytest.approx(ref_low, abs=0.015) and high == pytest.approx(ref_high, abs=0.015)
    assert low < roc_auc_score(member, score) < high


def test_each_resample_is_the_records_drawn_with_replacement_in_order() -> None:
    """A slow loop: bootstrap's resample r is the positives drawn n1 times with replacement, then the negatives n0
    times, from the generator in that order, scored by scikit-learn."""
    rng = np.random.default_rng(11)
    member = labels(7, 12)
    score = np.round(rng.normal(size=19) + 0.5 * member, 1)
    boot = bootstrap(member, score, rng=np.random.default_rng(12), resamples=5)
    replay = np.random.default_rng(12)
    drawn_positives, drawn_negatives = replay.integers(0, 7, size=(5, 7)), replay.integers(0, 12, size=(5, 12))
    pos, neg = score[member == 1], score[member == 0]
    for r in range(5):
        p, n = pos[drawn_positives[r]], neg[drawn_negatives[r]]
        assert boot.auc[r] == pytest.approx(roc_auc_score(labels(7, 12), np.concatenate([p, n])))


def test_resample_counts_are_multinomial() -> None:
    """Each row sums to n; over many rows each count has the Multinomial(n, 1/n) mean 1, variance 1 - 1/n and
    covariance -1/n with another record's (numpy's own multinomial beside it as the reference)."""
    n, rows = 6, 200_000
    counts = resample_counts(np.random.default_rng(13), n, rows)
    assert counts.shape == (rows, n) and (counts.sum(axis=1) == n).all()
    reference = np.random.default_rng(14).multinomial(n, np.full(n, 1 / n), size=rows)
    for drawn in (counts, reference):
        assert np.allclose(drawn.mean(axis=0), 1, atol=0.01)
        assert np.allclose(np.cov(drawn.T), np.eye(n) - 1 / n, atol=0.01)


def test_weighted_auc_equals_auc_of_the_repeated_records() -> None:
    rng = np.random.default_rng(4)
    pos, neg = np.round(rng.normal(0.5, 1, 40), 1), np.round(rng.normal(0, 1, 30), 1)
    w_pos, w_neg = rng.integers(0, 4, (5, 40)), rng.integers(1, 4, (5, 30))
    w_pos[:, 0] += 1
    got = weighted_auc(pos, neg, w_pos, w_neg)
    for r in range(5):
        p, n = np.repeat(pos, w_pos[r]), np.repeat(neg, w_neg[r])
        assert got[r] == pytest.approx(roc_auc_score(labels(p.size, n.size), np.concatenate([p, n])))


def test_tpr_at_low_fpr_sets_its_threshold_on_one_half_and_measures_on_the_other() -> None:
    # choosing half: 1000 non-members at 0..999; judged half: 100 members (5 above 999, 10 at 990.5..999.5, 85 low)
    # and 1000 non-members at 0.25..999.25
    member = np.concatenate([labels(0, 1000), labels(100, 1000)])
    score = np.concatenate(
        [np.arange(1000.0), np.full(5, 2000.0), np.arange(990.5, 1000.5), np.full(85, -1.0), np.arange(1000.0) + 0.25]
    )
    select = np.arange(score.size) < 1000
    entry = rates_at_fpr(member, score, select, 0.01)
    assert entry["threshold"] == 990.0  # the "higher" 99% quantile: 9 of the 1000 choosing non-members lie above it
    assert entry["tpr"] == pytest.approx(0.15) and entry["fpr"] == pytest.approx(0.010)  # 990.25 .. 999.25 above
    assert entry["fpr_ci95"][0] < 0.01 < entry["fpr_ci95"][1]
    assert rates_at_fpr(member, score, select, 0.001)["threshold"] == 999.0


def test_heavily_tied_scores_give_a_rate_at_the_target_fpr_or_none() -> None:
    """Scores with few distinct values (saturated losses). Ties at the threshold count as non-members, so a test
    chosen on one half stays at or below its FPR there; when the other half's scores sit above that threshold more
    often than the target allows (beyond the FPR's interval), the TPR is a rate at another FPR and is reported as
    not estimable, with the FPR it reached, never under the label of the target."""
    rng = np.random.default_rng(0)
    # 30% of the non-members tied at the top score 0, the rest at -1; members 60% at 0.
    nonmember_scores = np.where(rng.random(2000) < 0.3, 0.0, -1.0)
    member_scores = np.where(rng.random(600) < 0.6, 0.0, -1.0)
    member = np.concatenate([labels(300, 1000), labels(300, 1000)])
    score = np.concatenate([member_scores[:300], nonmember_scores[:1000], member_scores[300:], nonmember_scores[1000:]])
    select = np.arange(score.size) < 1300
    tied = rates_at_fpr(member, score, select, 0.01)
    assert tied["estimable"] and tied["threshold"] == 0.0 and tied["fpr"] == 0.0 and tied["tpr"] == 0.0
    assert tied["fpr_ci95"][0] <= 0.01 and tied["reason"] is None

    # The choosing half's non-members all tie at -1, the judged half's reach 0 one time in ten.
    shifted = score.copy()
    shifted[300:1300] = -1.0
    entry = rates_at_fpr(member, shifted, select, 0.01)
    assert not entry["estimable"] and entry["threshold"] == -1.0
    assert entry["fpr"] == pytest.approx(float((nonmember_scores[1000:] > -1).mean()))
    assert entry["fpr_ci95"][0] > 0.01 and "did not" not in entry["reason"]
    assert f"reached FPR {entry['fpr']:.3g}" in entry["reason"]

    too_few = rates_at_fpr(member, score, select, 0.0001)
    assert not too_few["estimable"] and too_few["tpr"] is None and "needs 10000" in too_few["reason"]


def test_newcombe_interval_of_a_difference_of_proportions() -> None:
    """Newcombe (1998), Table II, example (a): 56/70 - 48/80, method 10 (hybrid score): 0.0524 to 0.3339."""
    low, high = difference_interval(56, 70, 48, 80)
    assert (round(low, 4), round(high, 4)) == (0.0524, 0.3339)


def test_held_out_advantage_on_pure_noise_rarely_excludes_zero() -> None:
    """The largest TPR - FPR of the same records is always positive on noise; the held-out one is not, and its
    interval excludes 0 from above in at most 5% of samples (two-sided 95%: about 2.5% expected)."""
    positive = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        member = labels(300, 300)
        entry = held_out_advantage(member, rng.normal(size=600), halves(300, 300, seed))
        positive += entry["ci95"][0] > 0
    assert positive <= 10


def test_clopper_pearson_closed_forms_and_scipy() -> None:
    n = 50
    assert clopper_pearson_lower(np.array([n]), n) == pytest.approx(0.05 ** (1 / n))
    assert clopper_pearson_upper(np.array([0]), n) == pytest.approx(1 - 0.05 ** (1 / n))
    assert clopper_pearson_lower(np.array([0]), n) == 0.0 and clopper_pearson_upper(np.array([n]), n) == 1.0
    k = np.arange(1, n)
    assert np.all(clopper_pearson_lower(k, n) < k / n) and np.all(clopper_pearson_upper(k, n) > k / n)
    for successes in (0, 1, 17, 49, 50):  # one-sided 95% bounds are the ends of scipy's two-sided 90% exact interval
        exact = binomtest(successes, n).proportion_ci(confidence_level=0.90, method="exact")
        assert clopper_pearson_lower(np.array([successes]), n)[0] == pytest.approx(exact.low, abs=1e-12)
        assert clopper_pearson_upper(np.array([successes]), n)[0] == pytest.approx(exact.high, abs=1e-12)
        assert rate_interval(successes, n) == pytest.approx(list(binomtest(successes, n).proportion_ci(method="exact")))


def test_the_bound_is_one_fixed_test_judged_on_the_other_half() -> None:
    """The slow, obvious computation: pick the test on the selection half by brute force over every threshold,
    then apply that one test to the other half and bound it with scipy's exact binomial interval (two-sided 95%:
    each end one-sided at 97.5%, so that the two rates hold together at 95%)."""
    rng = np.random.default_rng(6)
    member = labels(400, 400)
    score = np.round(np.concatenate([rng.normal(1.5, 1, 400), rng.normal(0, 1, 400)]), 2)
    select = halves(400, 400, seed=1)
    delta = 1e-3
    got = epsilon_lower_bound(member, score, select, delta=delta)

    def one_sided(k: int, n: int) -> tuple[float, float]:
        ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
        return ci.low, ci.high

    def bounds(m: np.ndarray, s: np.ndarray, t: float) -> dict[str, float]:
        called = s >= t
        n1, n0 = int(m.sum()), int((m == 0).sum())
        tp, fp = int((called & (m == 1)).sum()), int((called & (m == 0)).sum())
        tpr_lo, fpr_hi = one_sided(tp, n1)[0], one_sided(fp, n0)[1]
        tnr_lo, fnr_hi = one_sided(n0 - fp, n0)[0], one_sided(n1 - tp, n1)[1]
        out = {}
        for name, lo, hi in (("tpr", tpr_lo, fpr_hi), ("tnr", tnr_lo, fnr_hi)):
            out[name] = math.log((lo - delta) / hi) if lo > delta and hi > 0 else -math.inf
        return out

    scores = np.unique(score[select])
    candidates = [
        (b, i, name) for i, t in enumerate(scores) for name, b in bounds(member[select], score[select], t).items()
    ]
    best, i, inequality = max(candidates, key=lambda c: (c[0], c[1]))
    threshold = (scores[i] + scores[i - 1]) / 2 if i > 0 else scores[i]  # halfway to the next lower score
    assert (got.threshold, got.inequality) == (pytest.approx(threshold), inequality)
    assert got.selection_bound == pytest.approx(best)
    expected = bounds(member[~select], score[~select], threshold)[inequality]
    assert got.epsilon == pytest.approx(max(0.0, expected), rel=1e-9)
    assert got.epsilon > 0.5


def test_bound_on_scores_independent_of_membership_is_rarely_positive() -> None:
    """At 95% confidence a valid bound may be positive on pure noise in at most 5% of samples (here: 200 seeds)."""
    positive = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        member = labels(1000, 1000)
        positive += bound(member, rng.normal(size=2000), delta=0.01, seed=seed) > 0
    assert positive <= 10


def test_bound_covers_the_truth_where_it_is_tight_and_the_old_procedure_did_not() -> None:
    """mu-GDP scores at delta 0.1 (the best threshold is moderate, so the bound is nearly tight) and randomised
    response at epsilon 2: the bound exceeds the true epsilon in at most 5% of 300 seeds. The maximum over every
    threshold of the same records (what fedaudit did before) exceeds it in more than 5% of the same samples."""
    mu, delta, n = 1.0, 0.1, 2000
    true_eps = gaussian_epsilon(mu, delta)
    above = above_old = 0
    for seed in range(300):
        rng = np.random.default_rng(seed)
        score = np.concatenate([rng.normal(mu, 1, n), rng.normal(0, 1, n)])
        above += bound(labels(n, n), score, delta=delta, seed=seed) > true_eps
        curve = roc(labels(n, n), score)
        every = threshold_bounds(  # the old procedure, with its rates at 95% each
            np.rint(curve.tpr * n), np.rint(curve.fpr * n), n, n, delta=delta, confidence=0.90
        )
        above_old += max(b.max() for b in every.values()) > true_eps
    assert above <= 15 < above_old
    above = 0
    for seed in range(300):
        member, score = randomised_response(2.0, 4000, seed=seed)
        above += bound(member, score, seed=seed) > 2.0
    assert above <= 15


@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0])
def test_epsilon_lower_bound_of_randomised_response(eps: float) -> None:
    few = bound(*randomised_response(eps, 200, seed=0))
    many = bound(*randomised_response(eps, 1_000_000, seed=0))
    assert few < many < eps
    assert many > 0.97 * eps


@pytest.mark.parametrize("mu", [1.0, 2.0])
def test_epsilon_lower_bound_of_two_gaussians_stays_below_the_truth(mu: float) -> None:
    """mu-GDP scores: the bound is below the closed-form epsilon in at least 95% of seeds."""
    delta = 1e-3
    true_eps = gaussian_epsilon(mu, delta)
    below = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        score = np.concatenate([rng.normal(mu, 1, 500), rng.normal(0, 1, 500)])
        below += bound(labels(500, 500), score, delta=delta, seed=seed) < true_eps
    assert below >= 95


def test_epsilon_lower_bound_of_two_gaussians_approaches_the_truth() -> None:
    """At a large delta the best threshold is moderate, so 20000 records per side come close to the closed form."""
    mu, delta = 1.0, 0.1
    true_eps = gaussian_epsilon(mu, delta)
    rng = np.random.default_rng(0)
    score = np.concatenate([rng.normal(mu, 1, 20000), rng.normal(0, 1, 20000)])
    got = bound(labels(20000, 20000), score, delta=delta)
    assert 0.88 * true_eps < got < true_eps
    few = bound(labels(500, 500), np.concatenate([rng.normal(mu, 1, 500), rng.normal(0, 1, 500)]), delta=delta)
    assert few < got  # more records, a tighter bound


def test_an_attack_worse_than_chance_gives_no_bound() -> None:
    """Only tests in the attack's own direction count: members scoring lower than non-members bound nothing."""
    rng = np.random.default_rng(3)
    member = labels(3000, 3000)
    score = np.concatenate([rng.normal(0, 1, 3000), rng.normal(1.0, 1, 3000)])
    assert bound(member, score) == 0.0
    assert bound(member, -score) > 0.5


def test_an_inverted_score_is_reported_as_measured_and_named_inverted():
    from fedaudit.attacks.metrics import direction, summarize

    rng = np.random.default_rng(7)
    member = np.r_[np.ones(500, int), np.zeros(500, int)]
    score = rng.normal(size=1000) + 0.8 * member
    every = np.ones(1000, bool)
    half = rng.permutation(1000) < 500
    right, _ = summarize(member, score, report=every, select=half, delta=1e-5, rng=rng, resamples=200)
    wrong, _ = summarize(member, -score, report=every, select=half, delta=1e-5, rng=rng, resamples=200)
    assert right["direction"] == "as expected" and wrong["direction"] == "inverted"
    assert wrong["auc"] == pytest.approx(1 - right["auc"]) and wrong["auc"] < 0.5
    assert direction([0.45, 0.55]) == "undetermined"


def test_a_client_of_an_easy_class_is_not_called_exposed():
    """Class 0 of 10 scores higher for members and non-members alike, and no client's members score above their
    classes' non-members; each client holds two classes, half and half. Judged among non-members of every class,
    client 0 (classes 0 and 1) shows a TPR at 1% FPR of about 7%, since class 0's non-members pass that threshold
    far more often than 1%; judged among its own classes' non-members, no client shows more than chance."""
    from fedaudit.attacks.metrics import risk

    rng = np.random.default_rng(9)
    n = 16000
    member = (np.arange(n) < n // 2).astype(int)
    client = np.where(member == 1, rng.integers(0, 5, n), -1)
    label = np.where(member == 1, 2 * client + rng.integers(0, 2, n), rng.integers(0, 10, n))
    score = rng.normal(size=n) + 2.0 * (label == 0)
    select = rng.permutation(n) < n // 2
    table = risk(
        member, score, report=~select, select=select, client=client, label=label, record=np.arange(n),
        source=np.full(n, "test"),
    )  # fmt: skip
    for k in range(5):
        rate = table["tpr_at_fpr_per_client"][str(k)]["0.01"]
        assert rate["tpr"] < 0.025, (k, rate)  # chance: 1% and what a threshold from ~800 non-members adds
    every_class = np.quantile(score[select & (member == 0)], 0.99, method="higher")
    assert (score[(client == 0) & ~select] > every_class).mean() > 0.05


def test_risk_equals_a_slow_loop_over_clients_classes_and_records():
    from fedaudit.attacks.metrics import rates_at_fpr, risk

    rng = np.random.default_rng(8)
    n = 3000
    member = (np.arange(n) < n // 2).astype(int)
    client = np.where(member == 1, rng.integers(0, 4, n), -1)
    label = np.where(member == 1, (client + rng.integers(0, 2, n)) % 3, rng.integers(0, 3, n))  # 2 classes a client
    score = rng.normal(size=n) + member * (client == 2)
    select = rng.permutation(n) < n // 2
    report = ~select
    table = risk(
        member, score, report=report, select=select, client=client, label=label, record=np.arange(n) + 7,
        source=np.full(n, "test"),
    )  # fmt: skip
    for k in range(4):
        classes = {int(label[i]) for i in range(n) if client[i] == k and member[i] == 1}
        keep = np.array([client[i] == k or (member[i] == 0 and int(label[i]) in classes) for i in range(n)])
        expected = rates_at_fpr(member[keep], score[keep], select[keep], 0.01)
        assert table["tpr_at_fpr_per_client"][str(k)]["0.01"] == expected
    for c in range(3):
        keep = (label == c) & ((member == 1) | (member == 0))
        assert table["tpr_at_fpr_per_class"][str(c)]["0.001"] == rates_at_fpr(
            member[keep], score[keep], select[keep], 0.001
        )
    audited_members = [i for i in range(n) if report[i] and member[i] == 1]
    top = sorted(audited_members, key=lambda i: -score[i])[:10]
    assert [row["record"] for row in table["most_exposed"]] == [i + 7 for i in top]
    outs = [score[i] for i in range(n) if report[i] and member[i] == 0]
    for row, i in zip(table["most_exposed"], top):
        assert row["exposure_fpr"] == sum(o >= score[i] for o in outs) / len(outs)
        assert row["client"] == client[i] and row["label"] == label[i] and row["source"] == "test"
    assert table["most_exposed"][0]["client"] == 2


def test_bootstrap_groups_is_each_sets_resampled_auc_with_shared_negative_draws() -> None:
    """A slow loop: the same draws of records with replacement, in the same order, turned into the drawn records
    and scored by scikit-learn, give every resample's AUC of every set of positives."""
    rng = np.random.default_rng(5)
    negatives = np.round(rng.normal(0, 1, 50), 1)
    sets = [np.round(rng.normal(0.5, 1, n), 1) for n in (1, 3, 8)]
    boots = bootstrap_groups(negatives, sets, rng=np.random.default_rng(6), resamples=4)
    replay = np.random.default_rng(6)
    drawn_negatives = replay.integers(0, negatives.size, size=(4, negatives.size))
    for positives, boot in zip(sets, boots):
        drawn_positives = replay.integers(0, positives.size, size=(4, positives.size))
        for r in range(4):
            p, n = positives[drawn_positives[r]], negatives[drawn_negatives[r]]
            assert boot.auc[r] == pytest.approx(roc_auc_score(labels(p.size, n.size), np.concatenate([p, n])))


def test_bootstrap_groups_interval_matches_the_single_set_bootstrap() -> None:
    rng = np.random.default_rng(7)
    negatives, positives = rng.normal(0, 1, 400), rng.normal(0.3, 1, 60)
    (shared,) = bootstrap_groups(negatives, [positives], rng=np.random.default_rng(8), resamples=4000)
    member = labels(60, 400)
    single = bootstrap(member, np.concatenate([positives, negatives]), rng=np.random.default_rng(9), resamples=4000)
    assert np.allclose(Bootstrap.interval(shared.auc), Bootstrap.interval(single.auc), atol=0.01)


@pytest.mark.parametrize("case", range(40))
def test_roc_and_auc_are_scikit_learns_to_the_bit(case: int) -> None:
    """fedaudit draws the ROC curve and its area without scikit-learn (its import is 2-3 s of every attack's
    start-up); they must equal scikit-learn's roc_curve (no points dropped) and roc_auc_score exactly: float64 and
    float32 scores, many ties (scores rounded to a few values), one record of a class, bool and integer labels."""
    rng = np.random.default_rng(case)
    n = int(rng.integers(2, 3000))
    member = rng.random(n) < rng.uniform(0.05, 0.95)
    member[0], member[-1] = True, False  # both classes
    if case % 4 == 3:
        member = np.zeros(n, dtype=bool)
        member[int(rng.integers(n))] = True  # a single member
    score = rng.normal(member * rng.uniform(0, 2), 1.0)
    if case % 3 == 1:
        score = np.round(score * 2) / 2  # ties
    if case % 5 == 2:
        score = score.astype(np.float32)
    labels = member.astype(np.int64) if case % 2 else member
    curve = roc(labels, score)
    fpr, tpr, thresholds = roc_curve(labels, score, drop_intermediate=False)
    for ours, theirs in ((curve.fpr, fpr), (curve.tpr, tpr), (curve.thresholds, thresholds)):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    assert auc_score(labels, score) == roc_auc_score(labels, score)


def test_roc_refuses_what_scikit_learn_refuses() -> None:
    with pytest.raises(ValueError, match="one class"):
        auc_score(np.ones(5, dtype=bool), np.arange(5.0))
    with pytest.raises(ValueError, match="finite"):
        auc_score(np.array([0, 1, 0]), np.array([0.1, np.nan, 0.3]))
    with pytest.raises(ValueError, match="0 or 1"):
        roc(np.array([0, 2, 0]), np.array([0.1, 0.2, 0.3]))

"""Label DP mechanisms: RR, RRTop-k and RRWithPrior against their closed forms (chi-square at a fixed seed) and
their epsilon against the formula."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from fedaudit.privacy.labeldp import (
    best_k,
    keep_probability,
    output_distribution,
    randomized_response,
    rr_top_k,
    rr_with_prior,
)

K = 10
SAMPLES = 200_000
SKEWED = torch.tensor([0.6, 0.2, 0.1] + [0.1 / 7] * 7, dtype=torch.float64)


def _frequencies(reported: torch.Tensor) -> torch.Tensor:
    return torch.bincount(reported.long(), minlength=K).to(torch.float64)


def _assert_follows(reported: torch.Tensor, expected: torch.Tensor) -> None:
    """Chi-square goodness of fit over the classes the closed form can report (the others must never appear)."""
    counts = _frequencies(reported)
    possible = expected > 0
    assert counts[~possible].sum() == 0
    if int(possible.sum()) == 1:  # one possible report: nothing to test beyond it
        return
    result = chisquare(counts[possible].numpy(), (expected[possible] * len(reported)).numpy())
    assert result.pvalue > 1e-3, (counts, expected * len(reported))


@pytest.mark.parametrize(
    ("epsilon", "keep", "other"),
    [(0.5, 0.1548, 0.09391), (1.0, 0.2320, 0.08534), (2.0, 0.4509, 0.06102), (5.0, 0.9428, 0.00635)],
)
def test_rr_keep_and_flip_probabilities_match_the_table(epsilon, keep, other) -> None:
    assert keep_probability(epsilon, K) == pytest.approx(keep, abs=1e-4)
    assert (1 - keep_probability(epsilon, K)) / (K - 1) == pytest.approx(other, rel=1e-3)
    assert keep_probability(math.inf, K) == 1.0 and keep_probability(0.0, K) == pytest.approx(1 / K)


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_rr_reports_follow_the_closed_form(epsilon) -> None:
    labels = torch.full((SAMPLES,), 3)
    reported = randomized_response(labels, K, epsilon, torch.Generator().manual_seed(1))
    expected = torch.full((K,), (1 - keep_probability(epsilon, K)) / (K - 1), dtype=torch.float64)
    expected[3] = keep_probability(epsilon, K)
    _assert_follows(reported, expected)


@pytest.mark.parametrize(("label", "k"), [(1, 3), (7, 3), (0, 1), (5, 10), (9, 4)])
def test_rr_top_k_reports_follow_the_closed_form_inside_and_outside_the_top_k(label, k) -> None:
    """Label 1 is in the top 3 of the skewed prior, label 7 is not (it must go to a uniform member of the top 3,
    never to any class)."""
    labels = torch.full((SAMPLES,), label)
    prior = SKEWED.expand(SAMPLES, K)
    reported = rr_top_k(labels, prior, k, 1.0, torch.Generator().manual_seed(2))
    _assert_follows(reported, output_distribution(label, SKEWED, k, 1.0))


def test_rr_with_prior_picks_k_star_of_the_formula() -> None:
    uniform = torch.full((1, K), 1 / K)
    assert int(best_k(uniform, 1.0)[0]) == K
    assert int(best_k(SKEWED[None], 1.0)[0]) == 1
    assert int(best_k(SKEWED[None], 2.0)[0]) == 3
    for epsilon in (0.3, 1.0, 4.0):  # k* maximises w_k, computed here one k at a time
        w = [keep_probability(epsilon, k) * float(SKEWED[:k].sum()) for k in range(1, K + 1)]
        assert int(best_k(SKEWED[None], epsilon)[0]) == 1 + max(range(K), key=w.__getitem__)


def test_rr_with_prior_under_a_uniform_prior_is_rr_draw_for_draw() -> None:
    labels = torch.randint(0, K, (5000,), generator=torch.Generator().manual_seed(3))
    uniform = torch.full((5000, K), 1 / K)
    a = rr_with_prior(labels, uniform, 1.0, torch.Generator().manual_seed(4))
    b = randomized_response(labels, K, 1.0, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)


def test_rr_with_prior_reports_follow_its_top_k_star() -> None:
    labels = torch.full((SAMPLES,), 2)
    reported = rr_with_prior(labels, SKEWED.expand(SAMPLES, K), 2.0, torch.Generator().manual_seed(5))
    _assert_follows(reported, output_distribution(2, SKEWED, 3, 2.0))


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 3.0])
def test_each_mechanism_is_exactly_epsilon_label_dp(epsilon) -> None:
    """max over labels y, y' and reports o of log P(o | y) / P(o | y') equals epsilon for RR and RRTop-k (k >= 2), and
    is 0 for RRTop-1, whatever the prior."""
    for prior in (torch.full((K,), 1 / K, dtype=torch.float64), SKEWED):
        for k in (1, 2, 3, K):
            rows = torch.stack([output_distribution(y, prior, k, epsilon) for y in range(K)])
            reachable = rows.sum(dim=0) > 0
            rows = rows[:, reachable]
            assert (rows > 0).all()  # every reachable report is reachable from every label
            ratio = (rows[:, None, :] / rows[None, :, :]).max()
            assert float(ratio.log()) == pytest.approx(epsilon if k > 1 else 0.0, abs=1e-12)


def test_the_random_stream_does_not_depend_on_the_labels() -> None:
    """Two draws per label whatever happens: what comes after a release cannot tell the labels apart."""
    states = []
    for labels in (torch.zeros(100, dtype=torch.long), torch.arange(100) % K):
        generator = torch.Generator().manual_seed(6)
        rr_with_prior(labels, SKEWED.expand(100, K), 1.0, generator)
        states.append(generator.get_state())
    assert torch.equal(*states)

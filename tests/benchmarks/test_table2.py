"""benchmarks/table2.py's reading of a run at a budget and of the paper's "mean +- sd", on known answers (its smoke
test runs the script end to end, but never prints the paper's rows)."""

from __future__ import annotations

import importlib
import statistics
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def table2():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        yield importlib.import_module("table2")


def test_a_budget_allows_the_rounds_whose_epsilon_is_within_it(table2) -> None:
    curve = [2.595, 3.397, 4.068, 9.985, 10.6]
    assert table2.rounds_within(curve, 2.79) == 1
    assert table2.rounds_within(curve, 10.18) == 4
    assert table2.rounds_within(curve, 2.595) == 1  # a budget equal to a round's epsilon allows that round
    assert table2.rounds_within(curve, 2.5) == 0
    assert table2.rounds_within(curve, 100.0) == 5


def test_the_mean_is_judged_against_the_paper_s_standard_deviation(table2) -> None:
    seeds = [59.97, 61.88, 59.87]
    assert table2.spread(seeds) == f"{statistics.mean(seeds):.2f} +- {statistics.stdev(seeds):.2f}" == "60.57 +- 1.13"
    assert table2.verdict(seeds, "59.85 +- 1.5") == "within (+0.72)"
    assert table2.verdict([47.08, 55.48, 44.39], "54.57 +- 2.9") == "outside (-5.59)"
    assert table2.verdict([55.0], "54.5 +- 0.5") == "within (+0.50)"  # the edge counts as within
    assert table2.spread([55.0]) == "55.00"


def test_its_budgets_are_the_paper_s(table2) -> None:
    assert table2.PAPER_EPSILONS == (2.79, 10.18)

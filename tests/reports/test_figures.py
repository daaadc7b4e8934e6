"""fedaudit.reports.figures: ROC curves that stop where their sample stops resolving, with a TPR band; the
privacy/utility plot's dodged points and separate no-DP panel; one colour per algorithm."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from scipy.stats import binomtest
from sklearn.metrics import roc_curve

from fedaudit.registry import ALGORITHMS
from fedaudit.reports import figures
from fedaudit.reports.collect import AttackSummary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def close_figures():
    """The draw_... functions hand their figures over; close them after each test."""
    yield
    plt.close("all")


def attack(members: int, nonmembers: int, *, shift: float = 0.8, seed: int = 0, record: bool = True) -> AttackSummary:
    """An attack on ``members`` members and ``nonmembers`` non-members (scores normal, members shifted up), with
    its full ROC table; ``record`` false: the counts are not recorded (results of an older fedaudit)."""
    rng = np.random.default_rng(seed)
    member = np.r_[np.ones(members), np.zeros(nonmembers)]
    score = np.r_[rng.normal(shift, 1.0, members), rng.normal(0.0, 1.0, nonmembers)]
    fpr, tpr, _ = roc_curve(member, score, drop_intermediate=False)
    return summary(pd.DataFrame({"fpr": fpr, "tpr": tpr}), members if record else None, nonmembers if record else None)


def summary(roc: pd.DataFrame, members: int | None, nonmembers: int | None) -> AttackSummary:
    return AttackSummary(
        name="loss-threshold",
        signal="loss",
        method="threshold",
        round=None,
        auc=0.6,
        auc_ci=None,
        tpr_at_1pct_fpr=None,
        tpr_at_0_1pct_fpr=None,
        balanced_accuracy=None,
        advantage=None,
        epsilon_lower_bound=None,
        accountant_epsilon=None,
        num_members=members,
        num_nonmembers=nonmembers,
        seed=0,
        roc=roc,
    )


def panels(fig: Figure):
    """The linear and the log-log axes of a ROC figure."""
    linear, loglog = fig.axes
    assert loglog.get_xscale() == "log" and linear.get_xscale() == "linear"
    return linear, loglog


def curve_lines(ax) -> list:
    """The ROC lines of an axes (solid), not the chance diagonal (dashed)."""
    return [line for line in ax.get_lines() if line.get_linestyle() == "-"]


def bands(ax) -> list[PolyCollection]:
    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def band_at(band: PolyCollection, x: float) -> tuple[float, float]:
    """The lowest and highest y of a band's outline at ``x``."""
    vertices = np.concatenate([path.vertices for path in band.get_paths()])
    ys = vertices[np.isclose(vertices[:, 0], x, rtol=1e-12, atol=0), 1]
    assert ys.size, f"the band has no vertex at x={x}"
    return float(ys.min()), float(ys.max())


# ---------------------------------------------------------------------------- roc_curves


def test_log_log_axes_start_at_one_over_the_number_of_nonmembers():
    fig = figures.draw_roc_curves([("a", attack(300, 287))], "ROC")
    _, loglog = panels(fig)
    assert loglog.get_xlim()[0] == pytest.approx(1 / 287, rel=1e-12)
    assert loglog.get_xlim()[0] != pytest.approx(1e-4)


def test_log_log_axes_start_at_the_smallest_resolution_of_several_curves():
    fig = figures.draw_roc_curves([("small", attack(300, 287)), ("large", attack(900, 1000, seed=1))], "ROC")
    _, loglog = panels(fig)
    assert loglog.get_xlim()[0] == pytest.approx(1 / 1000, rel=1e-12)
    assert loglog.get_ylim()[0] <= 1 / 1000  # the chance diagonal stays in view


def test_no_log_log_curve_runs_below_one_over_its_nonmembers():
    curves = [("small", attack(300, 287)), ("large", attack(900, 1000, seed=1))]
    _, loglog = panels(figures.draw_roc_curves(curves, "ROC"))
    lines = curve_lines(loglog)
    assert len(lines) == 2
    for line, n in zip(lines, (287, 1000)):
        x = np.asarray(line.get_xdata(), float)
        assert x.min() >= 1 / n * (1 - 1e-12)
        assert x.min() == pytest.approx(1 / n, rel=1e-12)  # it runs down to its resolution, not short of it
    for band, n in zip(bands(loglog), (287, 1000)):
        vertices = np.concatenate([path.vertices for path in band.get_paths()])
        assert vertices[:, 0].min() >= 1 / n * (1 - 1e-12)


def test_without_recorded_counts_the_curve_stops_at_the_resolution_its_table_shows():
    _, loglog = panels(figures.draw_roc_curves([("old", attack(300, 287, record=False))], "ROC"))
    assert loglog.get_xlim()[0] == pytest.approx(1 / 287, rel=1e-9)
    (line,) = curve_lines(loglog)
    assert np.min(line.get_xdata()) >= 1 / 287 * (1 - 1e-9)


@pytest.mark.parametrize("panel", [0, 1], ids=["linear", "log-log"])
def test_each_curve_has_a_band_equal_to_the_clopper_pearson_interval_of_its_tpr(panel):
    """At FPR 0.2 the TPR is 25 of 50 members: the band there is the exact two-sided 95% binomial interval."""
    roc = pd.DataFrame({"fpr": [0.0, 0.1, 0.2, 0.5, 1.0], "tpr": [0.0, 0.3, 0.5, 0.8, 1.0]})
    fig = figures.draw_roc_curves([("a", summary(roc, 50, 10))], "ROC")
    ax = panels(fig)[panel]
    (band,) = bands(ax)
    expected = binomtest(25, 50).proportion_ci(confidence_level=0.95, method="exact")
    low, high = band_at(band, 0.2)
    assert low == pytest.approx(expected.low, rel=1e-9)
    assert high == pytest.approx(expected.high, rel=1e-9)
    assert low < 0.5 < high
    (line,) = curve_lines(ax)
    assert to_hex(band.get_facecolor()[0]) == to_hex(line.get_color())  # the band is the curve's own
    assert band.get_facecolor()[0][3] < 0.5  # drawn faint


def test_the_band_is_exact_at_the_log_log_resolution_point():
    """At FPR 1/n the band is the interval of the TPR measured there (k of m members)."""
    summary_ = attack(300, 287)
    points = figures.roc_points(summary_)
    at = np.flatnonzero(np.isclose(points.fpr, 1 / 287))
    k = int(round(points.tpr[at].max() * 300))
    expected = binomtest(k, 300).proportion_ci(confidence_level=0.95, method="exact")
    assert points.members == 300 and points.resolution == pytest.approx(1 / 287)
    assert points.high[at].max() == pytest.approx(expected.high, rel=1e-9)
    if k:
        assert points.low[at].max() == pytest.approx(expected.low, rel=1e-9)


def test_sample_size_is_the_recorded_count_else_read_off_the_rates():
    rates = np.array([0, 1, 2, 5, 287]) / 287
    assert figures.sample_size(287, rates) == 287
    assert figures.sample_size(None, rates) == 287
    assert figures.sample_size(None, np.array([0.0, 0.3, 0.5, 1.0])) == 10
    assert figures.sample_size(None, np.array([0.0])) is None


def test_roc_curves_returns_a_png():
    assert figures.roc_curves([("a", attack(100, 100))], "ROC").startswith(PNG_MAGIC)


# ---------------------------------------------------------------------------- privacy_utility


def group(algorithm: str, epsilon: float, accuracy: float, auc: float, runs: int = 3) -> dict:
    """One row of :func:`fedaudit.reports.summary.group_rows` (several seeds: no intervals)."""
    return {
        "algorithm": algorithm,
        "budget": "no DP" if math.isinf(epsilon) else f"epsilon {epsilon:g}",
        "runs": runs,
        "epsilon_mean": epsilon,
        "final_accuracy_mean": accuracy,
        "final_accuracy_std": 0.02,
        "final_accuracy_n": runs,
        "final_accuracy_interval_low": np.nan,
        "final_accuracy_interval_high": np.nan,
        "attack_auc_mean": auc,
        "attack_auc_std": 0.01,
        "attack_auc_n": runs,
        "attack_auc_interval_low": np.nan,
        "attack_auc_interval_high": np.nan,
    }


def study(budgets=(1.0, 2.0, 4.0, 8.0), no_dp: bool = True) -> pd.DataFrame:
    """DP-FedAvg and FedLAP-DP at the same budgets, and (``no_dp``) FedAvg and FedDM without DP."""
    rows = [group("DP-FedAvg", e, 0.5 + 0.03 * e, 0.5 + 0.005 * e) for e in budgets]
    rows += [group("FedLAP-DP", e, 0.52 + 0.03 * e, 0.5 + 0.004 * e) for e in budgets]
    if no_dp:
        rows += [group("FedAvg", math.inf, 0.9, 0.58), group("FedDM", math.inf, 0.8, 0.6, runs=1)]
    return pd.DataFrame(rows)


def epsilon_axes(fig: Figure) -> list:
    return [ax for ax in fig.axes if ax.get_xlabel() == "epsilon"]


def no_dp_axes(fig: Figure) -> list:
    return [ax for ax in fig.axes if [t.get_text() for t in ax.get_xticklabels()] == ["no DP"]]


def points(ax) -> dict[str, tuple[np.ndarray, np.ndarray, str]]:
    """x, y and colour of each algorithm's error-bar line in ``ax``, by its label."""
    found = {}
    for container in ax.containers:
        line = container.lines[0]
        found[container.get_label()] = (
            np.asarray(line.get_xdata(), float),
            np.asarray(line.get_ydata(), float),
            to_hex(line.get_color()),
        )
    return found


@pytest.mark.parametrize("budgets", [(1.0, 2.0, 4.0, 8.0), (0.5, 2.0, 8.0, 32.0)], ids=["linear", "log"])
def test_algorithms_at_equal_epsilon_are_dodged_apart(budgets):
    fig = figures.draw_privacy_utility(study(budgets, no_dp=False))
    axes = epsilon_axes(fig)
    assert len(axes) == 2  # accuracy and AUC
    log = axes[0].get_xscale() == "log"
    assert log == (budgets[-1] / budgets[0] >= figures.LOG_EPSILON_SPAN)
    for ax in axes:
        drawn = points(ax)
        (fedavg_x, _, _), (fedlap_x, _, _) = drawn["DP-FedAvg"], drawn["FedLAP-DP"]
        assert np.all(np.abs(fedavg_x - fedlap_x) > 0)
        shift = fedlap_x / fedavg_x if log else fedlap_x - fedavg_x
        assert np.allclose(shift, shift[0])  # one offset per algorithm: a factor on a log axis, a sum otherwise
        true = np.array(budgets)
        closeness = np.abs(np.log(fedavg_x / true)) if log else np.abs(fedavg_x - true) / (true.max() - true.min())
        assert closeness.max() < 0.1  # a small offset: each point stays by its epsilon


def test_one_algorithm_is_not_moved():
    fig = figures.draw_privacy_utility(study(no_dp=False).query("algorithm == 'DP-FedAvg'"))
    for ax in epsilon_axes(fig):
        np.testing.assert_array_equal(points(ax)["DP-FedAvg"][0], [1.0, 2.0, 4.0, 8.0])


def test_no_dp_stands_apart_from_the_epsilon_axis():
    fig = figures.draw_privacy_utility(study())
    fig.canvas.draw()  # lay the panels out
    numeric, apart = epsilon_axes(fig), no_dp_axes(fig)
    assert len(numeric) == 2 and len(apart) == 2
    for eps_ax, dp_free in zip(numeric, apart):
        assert eps_ax is not dp_free
        assert dp_free.get_shared_y_axes().joined(eps_ax, dp_free)  # one y scale for both
        assert eps_ax.get_position().x1 < dp_free.get_position().x0  # a gap between them: the break
        labels = [t.get_text() for t in eps_ax.get_xticklabels()]
        assert "no DP" not in labels
        assert set(points(eps_ax)) == {"DP-FedAvg", "FedLAP-DP"}
        assert np.all(np.concatenate([x for x, _, _ in points(eps_ax).values()]) < 8.5)
        assert set(points(dp_free)) == {"FedAvg", "FedDM"}
        assert list(dp_free.get_xticks()) == [0.0]  # one label, no numeric scale
        fedavg, feddm = points(dp_free)["FedAvg"][0], points(dp_free)["FedDM"][0]
        assert fedavg[0] != feddm[0]
        assert not eps_ax.spines["right"].get_visible() and not dp_free.spines["left"].get_visible()


def test_only_runs_without_dp_get_no_epsilon_axis():
    fig = figures.draw_privacy_utility(study(budgets=()))
    assert epsilon_axes(fig) == [] and len(no_dp_axes(fig)) == 2


def test_a_dp_group_without_epsilon_is_not_drawn_as_no_dp():
    groups = pd.concat([study(no_dp=False), pd.DataFrame([group("DP-FedProx", math.nan, 0.6, 0.52)])])
    fig = figures.draw_privacy_utility(groups)
    assert no_dp_axes(fig) == []
    assert all("DP-FedProx" not in points(ax) for ax in fig.axes)


def test_an_algorithm_keeps_its_colour_whatever_else_is_drawn():
    groups = study()
    first = figures.draw_privacy_utility(groups)
    second = figures.draw_privacy_utility(groups.iloc[::-1].reset_index(drop=True))
    alone = figures.draw_privacy_utility(groups[groups["algorithm"] == "FedLAP-DP"])

    def colours(fig: Figure) -> dict[str, str]:
        return {label: colour for ax in fig.axes for label, (_, _, colour) in points(ax).items()}

    assert colours(first) == colours(second)
    assert colours(alone)["FedLAP-DP"] == colours(first)["FedLAP-DP"] == figures.algorithm_colour("FedLAP-DP")
    assert colours(first)["DP-FedAvg"] != colours(first)["FedLAP-DP"]


def test_algorithm_colour_is_one_per_algorithm_whatever_its_spelling():
    for name, entry in ALGORITHMS.items():
        colour = figures.algorithm_colour(name)
        assert colour == figures.algorithm_colour(entry.label) == figures.algorithm_colour(entry.dp_label)
        assert colour == to_hex(colour)
    known = {figures.algorithm_colour(name) for name in ALGORITHMS}
    assert len(known) == len(ALGORITHMS)
    assert set(ALGORITHMS) <= set(figures.ALGORITHM_COLOURS)
    unknown = figures.algorithm_colour("FedSomethingNew")
    assert unknown == figures.algorithm_colour("FedSomethingNew") == to_hex(unknown)


def test_privacy_utility_returns_a_png():
    assert figures.privacy_utility(study()).startswith(PNG_MAGIC)


def test_the_caption_says_how_points_are_placed():
    caption = figures.spread_caption(study())
    assert caption.startswith("error bars: standard deviation over seeds")
    assert "shifted slightly along the epsilon axis" in caption and '"no DP"' in caption
    plain = figures.spread_caption(study(no_dp=False).query("algorithm == 'DP-FedAvg'"))
    assert plain == "error bars: standard deviation over seeds"


def test_a_curve_with_no_fpr_inside_0_1_is_left_off_the_log_log_panel():
    degenerate = summary(pd.DataFrame({"fpr": [0.0, 1.0], "tpr": [0.0, 1.0]}), None, None)
    fig = figures.draw_roc_curves([("degenerate", degenerate), ("a", attack(300, 287))], "ROC")
    linear, loglog = panels(fig)
    assert len(curve_lines(linear)) == 2 and len(curve_lines(loglog)) == 1
    assert loglog.get_xlim()[0] == pytest.approx(1 / 287, rel=1e-12)


def test_canary_audits_get_a_panel_beside_the_accountants_line():
    """With a canary audit in some group, the trade-off figure gains a panel whose points are the audit bounds and
    whose dashed line is bound = epsilon; without one it keeps two panels."""
    groups = pd.DataFrame(
        {
            "algorithm": ["DP-FedAvg", "DP-FedAvg"],
            "budget": ["epsilon 2", "epsilon 8"],
            "runs": [1, 1],
            "epsilon_mean": [2.0, 8.0],
            **{f"{c}_{s}": [0.5, 0.6] for c in ("final_accuracy", "attack_auc") for s in ("mean",)},
            **{f"{c}_std": [np.nan, np.nan] for c in ("final_accuracy", "attack_auc", "canary_epsilon_lower_bound")},
            **{f"{c}_n": [1, 1] for c in ("final_accuracy", "attack_auc")},
            **{
                f"{c}_interval_{s}": [np.nan, np.nan] for c in ("final_accuracy", "attack_auc") for s in ("low", "high")
            },
            "canary_epsilon_lower_bound_mean": [0.7, 3.1],
            "canary_epsilon_lower_bound_n": [1, 1],
        }
    )
    fig = figures.draw_privacy_utility(groups)
    canary = [ax for ax in fig.axes if ax.get_title() == "Canary audit vs epsilon"]
    assert len(canary) == 1
    ys = sorted(float(y) for line in canary[0].get_lines() for y in np.atleast_1d(line.get_ydata()))
    assert 0.7 in ys and 3.1 in ys
    dashed = [line for line in canary[0].get_lines() if line.get_linestyle() == "--"]
    assert dashed and list(dashed[0].get_xdata()) == list(dashed[0].get_ydata())
    plt.close(fig)
    fig = figures.draw_privacy_utility(groups.assign(canary_epsilon_lower_bound_n=[0, 0]))
    assert not [ax for ax in fig.axes if ax.get_title() == "Canary audit vs epsilon"]
    plt.close(fig)

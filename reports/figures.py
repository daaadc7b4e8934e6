"""Report figures drawn with matplotlib (Agg backend), returned as PNG bytes.

Figures that a test inspects are drawn by a ``draw_...`` function that returns the matplotlib figure; the function of
the same name without ``draw_`` returns its PNG. An algorithm has one colour in every figure (:func:`algorithm_colour`).
"""

from __future__ import annotations

import colorsys
import io
import math
import zlib
from collections.abc import Mapping, Sequence
from fractions import Fraction
from types import MappingProxyType
from typing import Any, NamedTuple

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.gridspec import SubplotSpec  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

from fedaudit.attacks.metrics import clopper_pearson_lower, clopper_pearson_upper  # noqa: E402
from fedaudit.registry import ALGORITHMS, CLIENT_LEVEL_LABEL  # noqa: E402
from fedaudit.reports.collect import AttackSummary, ReconstructionSummary, RunSummary, SyntheticSet  # noqa: E402

DPI = 100
MIN_AUC_SPAN = 0.1
DEFAULT_LOG_FLOOR = 1e-3  # start of the log-log ROC axes when no curve resolves any FPR above 0
BAND_LEVEL = 0.95  # of the pointwise TPR band around each ROC curve
BAND_ALPHA = 0.15
MAX_RECORDS = 10**7  # the largest sample size read off an ROC table that did not record its own
LOG_EPSILON_SPAN = 20.0  # epsilons spanning this factor or more go on a log axis
MAX_BUDGET_TICKS = 8  # on a log epsilon axis, up to this many distinct budgets are its ticks
DODGE = 0.025  # offset between two algorithms' points at equal epsilon, as a fraction of the epsilons' span
DODGE_TOTAL = 0.15  # the widest spread of the offsets, whatever the number of algorithms
NO_DP = "no DP"
NO_DP_WIDTH = 0.22  # width of the no-DP panel beside the epsilon axis, relative to it

# One colour per algorithm (its registry entry's), the same in every figure: eight of matplotlib's tab10 (not its grey,
# which marks the accountant). An entry without one gets a colour from its name (algorithm_colour).
ALGORITHM_COLOURS: Mapping[str, str] = MappingProxyType(
    {entry.name: entry.colour for entry in ALGORITHMS.values() if entry.colour}
)
# Every way a report names a known algorithm (configuration name, label, DP label), lower-cased, to its name.
_ALGORITHM_NAMES: Mapping[str, str] = MappingProxyType(
    {
        spelling.lower(): entry.name
        for entry in ALGORITHMS.values()
        for spelling in (entry.name, entry.label, entry.dp_label)
    }
)


def png(fig: Figure) -> bytes:
    """Render a figure to PNG bytes and release it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def accuracy_curve(run: RunSummary) -> bytes:
    """Test accuracy after every round it was measured in (``--eval-every`` skips some: the line joins the others)."""
    measured = run.utility.dropna(subset=["test_accuracy"])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(measured["round"], measured["test_accuracy"], marker="o")
    ax.set(xlabel="round", ylabel="test accuracy", title=f"Utility: {run.name}", ylim=(0, 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return png(fig)


def epsilon_curve(run: RunSummary) -> bytes:
    """The accountant's epsilon after every round."""
    eps = run.privacy.epsilon_per_round
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(eps) + 1), eps, marker="o", color="tab:red")
    ax.set(xlabel="round", ylabel=f"epsilon (delta={run.privacy.delta:g})", title=f"Privacy budget: {run.name}")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    return png(fig)


def roc_curves(curves: Sequence[tuple[str, AttackSummary]], title: str) -> bytes:
    """ROC curves on linear and log-log axes side by side, each with its TPR band (:func:`draw_roc_curves`)."""
    return png(draw_roc_curves(curves, title))


def draw_roc_curves(curves: Sequence[tuple[str, AttackSummary]], title: str) -> Figure:
    """ROC curves on linear and log-log axes side by side, with the chance diagonal.

    Each curve carries a pointwise 95% Clopper-Pearson band for its TPR: at every point of the curve, the two-sided
    interval of that TPR over the attack's members, with the FPR taken as fixed (its own error, over the non-members,
    is not in the band), and each point's interval holding on its own, not for the whole curve at once. On the
    log-log panel a curve stops at FPR 1/n, n its number of non-members (nothing below is measured), and the axes
    start at the smallest such 1/n of the curves; TPRs below the TPR axis's start (1/members) sit on its edge.
    """
    fig, (linear, loglog) = plt.subplots(1, 2, figsize=(10, 4))
    drawn = [(label, attack, roc_points(attack)) for label, attack in curves]
    x_floor = min((c.resolution for *_, c in drawn if c.resolution is not None), default=DEFAULT_LOG_FLOOR)
    y_floor = min([x_floor, *(1.0 / c.members for *_, c in drawn if c.members)])
    for label, attack, curve in drawn:
        auc = "n/a" if attack.auc is None else f"{attack.auc:.3f}"
        (line,) = linear.plot(curve.fpr, curve.tpr, label=f"{label} (AUC {auc})")
        colour = line.get_color()
        if curve.low is not None:
            linear.fill_between(curve.fpr, curve.low, curve.high, color=colour, alpha=BAND_ALPHA, linewidth=0)
        if curve.resolution is None:
            continue
        shown = curve.fpr >= curve.resolution * (1.0 - 1e-9)
        loglog.plot(curve.fpr[shown], np.clip(curve.tpr[shown], y_floor, 1), color=colour)
        if curve.low is not None:
            loglog.fill_between(
                curve.fpr[shown],
                np.clip(curve.low[shown], y_floor, 1),
                np.clip(curve.high[shown], y_floor, 1),
                color=colour,
                alpha=BAND_ALPHA,
                linewidth=0,
            )
    diagonal = np.logspace(math.log10(x_floor), 0, 50)
    linear.plot([0, 1], [0, 1], "k--", lw=0.8, label="chance")
    loglog.plot(diagonal, diagonal, "k--", lw=0.8)
    linear.set(
        xlabel="false positive rate", ylabel="true positive rate", title=f"{title} (linear)", xlim=(0, 1), ylim=(0, 1)
    )
    loglog.set(
        xlabel="false positive rate (from 1 / non-members)",
        ylabel="true positive rate",
        title=f"{title} (log-log)",
        xscale="log",
        yscale="log",
        xlim=(x_floor, 1),
        ylim=(y_floor, 1),
    )
    handles, labels = linear.get_legend_handles_labels()
    if any(c.low is not None for *_, c in drawn):
        handles.append(Patch(facecolor="0.5", alpha=2 * BAND_ALPHA, linewidth=0))
        labels.append(f"{BAND_LEVEL:.0%} band of TPR (pointwise)")
    linear.legend(handles, labels, fontsize=7, loc="lower right")
    for ax in (linear, loglog):
        ax.grid(alpha=0.3, which="both")
    return fig


class RocPoints(NamedTuple):
    """An attack's ROC points, the interval of each TPR and the sample sizes behind them."""

    fpr: np.ndarray
    tpr: np.ndarray
    low: np.ndarray | None  # two-sided Clopper-Pearson interval of each TPR; None when the members are unknown
    high: np.ndarray | None
    members: int | None
    resolution: float | None  # the smallest FPR the sample resolves, 1/non-members; None: none below 1


def roc_points(attack: AttackSummary) -> RocPoints:
    """An attack's ROC table with the pointwise :data:`BAND_LEVEL` Clopper-Pearson interval of each TPR over its
    members, and its resolution 1/n over its n non-members (the smallest positive FPR of the table when n is not
    known)."""
    table = attack.roc if attack.roc is not None else pd.DataFrame({"fpr": [], "tpr": []})
    fpr, tpr = table["fpr"].to_numpy(float), table["tpr"].to_numpy(float)
    nonmembers = sample_size(attack.num_nonmembers, fpr)
    positive = fpr[fpr > 0]
    resolution = 1.0 / nonmembers if nonmembers else (float(positive.min()) if positive.size else None)
    if resolution is not None and resolution >= 1.0:  # no FPR between 0 and 1 measured: nothing for log axes
        resolution = None
    members = sample_size(attack.num_members, tpr)
    if not members:
        return RocPoints(fpr, tpr, None, None, None, resolution)
    hits = np.clip(np.round(tpr * members), 0, members)
    tail = (1.0 + BAND_LEVEL) / 2.0
    low = clopper_pearson_lower(hits, members, confidence=tail)
    high = clopper_pearson_upper(hits, members, confidence=tail)
    return RocPoints(fpr, tpr, low, high, members, resolution)


def sample_size(recorded: int | None, rates: np.ndarray) -> int | None:
    """How many records the ``rates`` (counts over n) are over: the recorded n, else, for results that did not record
    it, the smallest n that makes every rate a whole count (at most the true n, so a band from it is no narrower and
    a curve cut at its 1/n no longer); None when the rates cannot tell."""
    if recorded:
        return int(recorded)
    rates = np.unique(rates[np.isfinite(rates)])
    if rates.size < 2:
        return None
    denominators = (Fraction(float(r)).limit_denominator(MAX_RECORDS).denominator for r in rates)
    n = math.lcm(*denominators)
    return n if n <= MAX_RECORDS else None


def auc_per_round(attacks: Sequence[AttackSummary], title: str) -> bytes:
    """AUC (with its interval) after every attacked round, one line per signal/method."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = sorted({a.label for a in attacks})
    for label in labels:
        points = sorted(
            (a for a in attacks if a.label == label and a.auc is not None and a.round is not None),
            key=lambda a: a.round,
        )
        rounds = [a.round for a in points]
        aucs = np.array([a.auc for a in points])
        lo = np.array([a.auc_ci[0] if a.auc_ci else a.auc for a in points])
        hi = np.array([a.auc_ci[1] if a.auc_ci else a.auc for a in points])
        ax.errorbar(rounds, aucs, yerr=[aucs - lo, hi - aucs], marker="o", capsize=3, label=label)
    ax.axhline(0.5, color="k", ls="--", lw=0.8)
    ax.set(xlabel="round", ylabel="attack AUC (95% interval)", title=title)
    auc_axis(ax)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return png(fig)


def auc_axis(ax: plt.Axes) -> None:
    """An AUC axis that shows chance (0.5) and spans at least :data:`MIN_AUC_SPAN`, so that noise of a few
    thousandths does not fill the plot and look like a trend."""
    low, high = ax.get_ylim()
    low, high = min(low, 0.49), max(high, 0.51)  # chance inside, not on the frame
    if high - low < MIN_AUC_SPAN:
        middle = (low + high) / 2.0
        low, high = middle - MIN_AUC_SPAN / 2.0, middle + MIN_AUC_SPAN / 2.0
    ax.set_ylim(max(0.0, low), min(1.0, high))


def canary_audit(audits: Sequence[AttackSummary]) -> bytes:
    """Each canary audit's 95% lower bound beside the accountant's epsilon (bars), and the one-run bound of the k
    highest-scoring guesses against k (one curve per audit)."""
    fig, (bars, curve) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1, 1.4]})
    accountant = next((a.accountant_epsilon for a in audits if a.accountant_epsilon is not None), None)
    labels = [a.signal for a in audits]
    bounds = [a.epsilon_lower_bound or 0.0 for a in audits]
    colors = ["tab:red" if a.exceeds_accountant else "tab:blue" for a in audits]
    if accountant is not None:
        labels, bounds, colors = ["accountant", *labels], [accountant, *bounds], ["tab:gray", *colors]
    bars.barh(range(len(labels)), bounds, color=colors)
    bars.set_yticks(range(len(labels)), labels)
    bars.invert_yaxis()
    bars.set(xlabel="epsilon", title="Audited lower bound (95%) vs accountant")
    bars.grid(axis="x", alpha=0.3)
    for audit in audits:
        points = (audit.canary_audit or {}).get("bound_by_guesses") or []
        if points:
            curve.plot([p["guesses"] for p in points], [p["epsilon"] for p in points], marker=".", label=audit.signal)
    if accountant is not None:
        curve.axhline(accountant, color="tab:gray", linestyle="--", label="accountant")
    curve.set_xscale("log")
    curve.set(xlabel="guesses (k highest scores called in)", ylabel="one-run epsilon bound", title="Bound by guesses")
    curve.set_ylim(bottom=0)
    curve.grid(alpha=0.3)
    curve.legend(fontsize=8)
    return png(fig)


def synthetic_grid(sets: Sequence[SyntheticSet], title: str) -> bytes:
    """One row of synthetic images per client, each image titled with its label."""
    columns = max(len(s.images) for s in sets)
    fig, axes = plt.subplots(len(sets), columns, figsize=(1.1 * columns + 1, 1.2 * len(sets) + 0.6), squeeze=False)
    for row, synthetic in zip(axes, sets):
        for column, ax in enumerate(row):
            ax.set_xticks([])
            ax.set_yticks([])
            if column >= len(synthetic.images):
                ax.axis("off")
                continue
            image = synthetic.images[column].astype(np.float32)
            image = (image - image.min()) / max(float(image.max() - image.min()), 1e-12)
            if image.shape[0] == 1:
                ax.imshow(image[0], cmap="gray", vmin=0, vmax=1)
            else:
                ax.imshow(np.transpose(image[:3], (1, 2, 0)))
            ax.set_title(f"label {int(synthetic.labels[column])}", fontsize=7)
        row[0].set_ylabel(f"client {synthetic.client}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    return png(fig)


GRID_PAIRS = 8  # originals beside their reconstructions in a report's grid


def reconstruction_grid(results: Sequence[ReconstructionSummary], title: str) -> bytes:
    """The best reconstructions of a run (:func:`draw_reconstruction_grid`) as PNG."""
    return png(draw_reconstruction_grid(results, title))


def draw_reconstruction_grid(results: Sequence[ReconstructionSummary], title: str) -> Figure:
    """Originals (top row) above their reconstructions (bottom row), the worst case for privacy first: the
    :data:`GRID_PAIRS` reconstructions of highest PSNR over every result given, each titled with its round, client
    and PSNR. Images are in pixel space [0, 1], shown as they are (not rescaled)."""
    pairs = [
        (float(psnr), result.round, result.client, original, rebuilt)
        for result in results
        if result.images is not None
        for rebuilt, original, psnr in zip(*result.images)
    ]
    pairs.sort(key=lambda pair: -pair[0])
    pairs = pairs[:GRID_PAIRS]
    fig, axes = plt.subplots(2, max(len(pairs), 1), figsize=(1.3 * max(len(pairs), 1) + 0.8, 3.2), squeeze=False)
    for column in range(axes.shape[1]):
        for row in range(2):
            ax = axes[row, column]
            ax.set_xticks([])
            ax.set_yticks([])
            if column >= len(pairs):
                ax.axis("off")
                continue
            psnr, number, client, original, rebuilt = pairs[column]
            image = np.clip((original, rebuilt)[row].astype(np.float32), 0.0, 1.0)
            if image.shape[0] == 1:
                ax.imshow(image[0], cmap="gray", vmin=0, vmax=1)
            else:
                ax.imshow(np.transpose(image[:3], (1, 2, 0)))
            if row == 0:
                ax.set_title(f"r{number} c{client}", fontsize=7)
            else:
                ax.set_xlabel("inf dB" if math.isinf(psnr) else f"{psnr:.1f} dB", fontsize=7)
    axes[0, 0].set_ylabel("original", fontsize=8)
    axes[1, 0].set_ylabel("rebuilt", fontsize=8)
    fig.suptitle(title, fontsize=9)
    return fig


def reconstruction_epsilon(points: pd.DataFrame) -> bytes:
    """Reconstruction quality against epsilon (:func:`draw_reconstruction_epsilon`) as PNG."""
    return png(draw_reconstruction_epsilon(points))


def draw_reconstruction_epsilon(points: pd.DataFrame) -> Figure:
    """Mean PSNR of the reconstructed records against the accountant's epsilon of the attacked round, one point per
    run and attacked round (columns: algorithm, epsilon, psnr, psnr_low, psnr_high, null_psnr, threshold), in the
    algorithm's colour with its 95% interval over the records; the null's mean (a random update of the same norm, or
    held-out records) as a grey cross beside it, and the recovery threshold as a dashed line. Runs without DP stand
    in a panel of their own at the right, as in :func:`draw_privacy_utility`."""
    epsilon = points["epsilon"].to_numpy(float)
    algorithms = points["algorithm"].astype(str).to_numpy()
    dp, no_dp = np.isfinite(epsilon), np.isposinf(epsilon)
    log = bool(dp.any() and epsilon[dp].min() > 0 and epsilon[dp].max() >= LOG_EPSILON_SPAN * epsilon[dp].min())
    x = np.full(epsilon.shape, np.nan)
    x[dp] = _dodged(epsilon[dp], algorithms[dp], log)
    x[no_dp] = _side_by_side(algorithms[no_dp])
    fig = plt.figure(figsize=(6, 3.8), layout="constrained")
    cell = fig.add_gridspec(1, 1)[0]
    eps_ax, apart_ax = _epsilon_axes(fig, cell, bool(dp.any() or not no_dp.any()), bool(no_dp.any()))
    for ax, rows in ((eps_ax, dp), (apart_ax, no_dp)):
        if ax is None:
            continue
        for algorithm in dict.fromkeys(algorithms[rows]):
            chosen = rows & (algorithms == algorithm)
            mean = points["psnr"].to_numpy(float)[chosen]
            low = points["psnr_low"].to_numpy(float)[chosen]
            high = points["psnr_high"].to_numpy(float)[chosen]
            below, above = np.nan_to_num(mean - low), np.nan_to_num(high - mean)
            ax.errorbar(
                x[chosen],
                mean,
                yerr=[below, above],
                marker="o",
                ls="none",
                capsize=3,
                color=algorithm_colour(algorithm),
                label=algorithm,
            )
        ax.scatter(
            x[rows],
            points["null_psnr"].to_numpy(float)[rows],
            marker="x",
            s=60,
            zorder=3,
            color="tab:gray",
            label="null",
        )
        for threshold in points["threshold"].dropna().unique():
            ax.axhline(float(threshold), color="k", ls="--", lw=0.8, label="recovered at or above")
    first = eps_ax if eps_ax is not None else apart_ax
    first.set(ylabel="mean PSNR of the records (dB)", title="Reconstruction vs epsilon")
    first.set_ylim(bottom=0)
    if eps_ax is not None:
        eps_ax.set_xlabel("epsilon of the attacked round")
        if log:
            _log_epsilon_axis(eps_ax, epsilon[dp])
        eps_ax.grid(alpha=0.3)
    if apart_ax is not None:
        apart_ax.set_xlim(-1.0, 1.0)
        apart_ax.set_xticks([0.0], labels=[NO_DP])
        apart_ax.grid(alpha=0.3, axis="y")
    handles: dict[str, Any] = {}
    for ax in (eps_ax, apart_ax):
        if ax is not None:
            handles.update({name: handle for handle, name in zip(*ax.get_legend_handles_labels())})
    first.legend(list(handles.values()), list(handles), fontsize=7)
    return fig


def privacy_utility(groups: pd.DataFrame) -> bytes:
    """Final test accuracy and strongest attack AUC against the accountant's epsilon (:func:`draw_privacy_utility`)."""
    return png(draw_privacy_utility(groups))


def draw_privacy_utility(groups: pd.DataFrame) -> Figure:
    """Final test accuracy and strongest attack AUC against the accountant's epsilon, one line per algorithm through
    its budgets (:func:`reports.summary.group_rows`), in the algorithm's own colour (:func:`algorithm_colour`); when
    some runs were audited with canaries, a third panel puts their audit's bound beside the line bound = epsilon (a
    point above it means the implementation does not keep the accountant's promise).

    Error bars: the standard deviation over seeds for a group of several seeds; for a group of one run, its 95%
    intervals (accuracy: over the test split; AUC: simultaneous over its attacks). Each algorithm's points are shifted
    by a small offset of its own along the epsilon axis (a factor on a log axis), so that bars at equal epsilon do
    not hide each other: a point's x is its epsilon up to that offset. Runs without DP (infinite epsilon) are not on
    the epsilon axis: they stand in a narrow panel of their own at the right, marked "no DP" and set off by a break.
    Groups whose epsilon is unknown (DP without a ledger) have no place on either and are left out.
    """
    epsilon = groups["epsilon_mean"].to_numpy(float)
    algorithms = groups["algorithm"].astype(str).to_numpy()
    dp, no_dp = np.isfinite(epsilon), np.isposinf(epsilon)
    log = bool(dp.any() and epsilon[dp].min() > 0 and epsilon[dp].max() >= LOG_EPSILON_SPAN * epsilon[dp].min())
    x = np.full(epsilon.shape, np.nan)
    x[dp] = _dodged(epsilon[dp], algorithms[dp], log)
    x[no_dp] = _side_by_side(algorithms[no_dp])
    metrics = (
        ("final_accuracy", "final test accuracy", "Accuracy vs epsilon"),
        ("attack_auc", "strongest attack AUC", "Attack AUC vs epsilon"),
    )
    if "canary_epsilon_lower_bound_n" in groups and groups["canary_epsilon_lower_bound_n"].gt(0).any():
        metrics += (("canary_epsilon_lower_bound", "canary audit bound (95%)", "Canary audit vs epsilon"),)
    fig = plt.figure(figsize=(5 * len(metrics), 3.8), layout="constrained")
    for cell, (column, ylabel, title) in zip(fig.add_gridspec(1, len(metrics), wspace=0.08), metrics):
        eps_ax, apart_ax = _epsilon_axes(fig, cell, bool(dp.any() or not no_dp.any()), bool(no_dp.any()))
        for ax, rows, marker in ((eps_ax, dp, "o"), (apart_ax, no_dp, "s")):
            if ax is not None:
                _draw_algorithms(ax, groups, column, rows, x, marker)
        first = eps_ax if eps_ax is not None else apart_ax
        first.set(ylabel=ylabel, title=title)
        if eps_ax is not None:
            client = [CLIENT_LEVEL_LABEL in name for name in algorithms[dp]]
            mixed = any(client) and not all(client)
            eps_ax.set_xlabel("epsilon (per record; client-level series: per client)" if mixed else "epsilon")
            if log:
                _log_epsilon_axis(eps_ax, epsilon[dp])
            eps_ax.grid(alpha=0.3)
        if apart_ax is not None:
            apart_ax.set_xlim(-1.0, 1.0)
            apart_ax.set_xticks([0.0], labels=[NO_DP])
            apart_ax.grid(alpha=0.3, axis="y")
        if column == "canary_epsilon_lower_bound" and eps_ax is not None and dp.any():
            span = np.array([0.0, float(epsilon[dp].max())])
            eps_ax.plot(span, span, color="tab:gray", ls="--", lw=0.8, label="accountant (bound = epsilon)")
            eps_ax.set_ylim(bottom=0)
        if column == "attack_auc":
            for ax in (eps_ax, apart_ax):
                if ax is not None:
                    ax.axhline(0.5, color="k", ls="--", lw=0.8)
            auc_axis(first)
        handles: dict[str, Any] = {}
        for ax in (eps_ax, apart_ax):
            if ax is not None:
                handles.update({name: handle for handle, name in zip(*ax.get_legend_handles_labels())})
        if handles:
            first.legend(list(handles.values()), list(handles), fontsize=7)
    return fig


def _log_epsilon_axis(ax: plt.Axes, epsilon: np.ndarray) -> None:
    """A log epsilon axis, its ticks at the budgets themselves when they are few, else at powers of ten."""
    ax.set_xscale("log")
    budgets = np.unique(epsilon)
    if budgets.size <= MAX_BUDGET_TICKS:
        ax.set_xticks(budgets, labels=[f"{b:.3g}" for b in budgets])
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))


def _epsilon_axes(
    fig: Figure, cell: SubplotSpec, numeric: bool, apart: bool
) -> tuple[plt.Axes | None, plt.Axes | None]:
    """The epsilon axes of one panel and, when there are runs without DP, the narrow axes beside it that holds them
    (sharing its y axis, set off by a gap and break marks); either is None when it has nothing to show."""
    if not apart:
        return fig.add_subplot(cell), None
    if not numeric:
        return None, fig.add_subplot(cell)
    inner = cell.subgridspec(1, 2, width_ratios=(1.0, NO_DP_WIDTH), wspace=0.04)
    eps_ax = fig.add_subplot(inner[0])
    apart_ax = fig.add_subplot(inner[1], sharey=eps_ax)
    eps_ax.spines["right"].set_visible(False)
    apart_ax.spines["left"].set_visible(False)
    apart_ax.tick_params(axis="y", left=False, labelleft=False)
    slash = {"marker": [(-1, -2), (1, 2)], "markersize": 9, "linestyle": "none", "color": "k", "clip_on": False}
    eps_ax.plot([1, 1], [0, 1], transform=eps_ax.transAxes, label="_break", **slash)
    apart_ax.plot([0, 0], [0, 1], transform=apart_ax.transAxes, label="_break", **slash)
    return eps_ax, apart_ax


def _dodged(values: np.ndarray, algorithms: np.ndarray, log: bool) -> np.ndarray:
    """``values`` moved apart by algorithm: the k-th of K algorithms (in order of appearance) by (k - (K - 1) / 2)
    steps of :data:`DODGE` of the values' span (of their log10 span when ``log``, as a factor), so that points at
    equal epsilon stand side by side."""
    names = list(dict.fromkeys(algorithms))
    if not values.size or len(names) < 2:
        return values.astype(float)
    slot = np.array([names.index(name) for name in algorithms], dtype=float) - (len(names) - 1) / 2.0
    step = min(DODGE, DODGE_TOTAL / (len(names) - 1))
    if log:
        decades = float(np.log10(values.max() / values.min())) or 1.0
        return values * 10.0 ** (slot * step * decades)
    span = float(values.max() - values.min()) or float(np.abs(values).max()) or 1.0
    return values + slot * step * span


def _side_by_side(algorithms: np.ndarray) -> np.ndarray:
    """Positions in the no-DP panel (x from -1 to 1, no scale): one column per algorithm, centred on 0."""
    names = list(dict.fromkeys(algorithms))
    step = min(0.4, 1.2 / max(len(names) - 1, 1))
    return np.array([(names.index(name) - (len(names) - 1) / 2.0) * step for name in algorithms], dtype=float)


def _draw_algorithms(
    ax: plt.Axes, groups: pd.DataFrame, column: str, rows: np.ndarray, x: np.ndarray, marker: str
) -> None:
    """One error-bar line per algorithm of the ``rows`` groups at positions ``x``, in its colour."""
    algorithms = groups["algorithm"].astype(str).to_numpy()
    measured = groups[f"{column}_n"].gt(0).to_numpy()
    for algorithm in dict.fromkeys(algorithms[rows]):
        chosen = rows & measured & (algorithms == algorithm)
        if not chosen.any():
            continue
        order = np.argsort(x[chosen], kind="stable")
        mean = groups[f"{column}_mean"].to_numpy(float)[chosen][order]
        std = np.nan_to_num(groups[f"{column}_std"].to_numpy(float)[chosen][order])
        nothing = pd.Series(np.nan, index=groups.index)
        low = groups.get(f"{column}_interval_low", nothing).to_numpy(float)[chosen][order]
        high = groups.get(f"{column}_interval_high", nothing).to_numpy(float)[chosen][order]
        one = np.isfinite(low) & np.isfinite(high)
        below, above = np.where(one, mean - low, std), np.where(one, high - mean, std)
        ax.errorbar(
            x[chosen][order],
            mean,
            yerr=[below, above],
            marker=marker,
            capsize=3,
            color=algorithm_colour(algorithm),
            label=algorithm,
        )


def algorithm_colour(algorithm: str) -> str:
    """The one colour an algorithm has in every figure of a report, whatever else is drawn beside it.

    Known algorithms (by configuration name or label, with or without DP: "fedavg", "FedAvg" and "DP-FedAvg" are one)
    have a fixed colour of :data:`ALGORITHM_COLOURS`; any other name gets a colour derived from its own letters.
    """
    key = algorithm.strip().lower()
    name = _ALGORITHM_NAMES.get(key, key)
    if name in ALGORITHM_COLOURS:
        return ALGORITHM_COLOURS[name]
    hue = (zlib.crc32(name.encode("utf-8")) % 360) / 360.0
    return to_hex(colorsys.hls_to_rgb(hue, 0.4, 0.65))


def spread_caption(groups: pd.DataFrame) -> str:
    """What the error bars of :func:`privacy_utility` show, for these groups, and how its points are placed."""
    several, single = bool((groups["runs"] > 1).any()), bool((groups["runs"] == 1).any())
    seeds = "standard deviation over seeds"
    one = (
        "one seed: 95% intervals (test accuracy over the test split; the strongest attack's AUC simultaneous "
        "over its attacks)"
    )
    if several and single:
        caption = f"error bars: {seeds} for settings with several seeds; for settings with {one}"
    else:
        caption = f"error bars: {seeds}" if several else f"error bars, {one}"
    epsilon = groups["epsilon_mean"].to_numpy(float)
    if groups["algorithm"][np.isfinite(epsilon)].nunique() > 1:
        caption += "; each algorithm's points are shifted slightly along the epsilon axis so that bars do not overlap"
    if np.isposinf(epsilon).any():
        caption += f'; runs without DP stand apart at the right, marked "{NO_DP}"'
    return caption

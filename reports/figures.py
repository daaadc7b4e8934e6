"""Report figures drawn with matplotlib (Agg backend), returned as PNG bytes."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from fedaudit.reports.collect import AttackSummary, RunSummary, SyntheticSet  # noqa: E402

DPI = 100
LOG_FLOOR = 1e-4
MIN_AUC_SPAN = 0.1


def png(fig: Figure) -> bytes:
    """Render a figure to PNG bytes and release it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def accuracy_curve(run: RunSummary) -> bytes:
    """Test accuracy after every round."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(run.utility["round"], run.utility["test_accuracy"], marker="o")
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
    """ROC curves on linear and log-log axes side by side, with the chance diagonal."""
    fig, (linear, loglog) = plt.subplots(1, 2, figsize=(10, 4))
    for label, attack in curves:
        fpr, tpr = attack.roc["fpr"].to_numpy(float), attack.roc["tpr"].to_numpy(float)
        auc = "n/a" if attack.auc is None else f"{attack.auc:.3f}"
        linear.plot(fpr, tpr, label=f"{label} (AUC {auc})")
        loglog.plot(np.clip(fpr, LOG_FLOOR, 1), np.clip(tpr, LOG_FLOOR, 1))
    diagonal = np.logspace(math.log10(LOG_FLOOR), 0, 50)
    linear.plot([0, 1], [0, 1], "k--", lw=0.8, label="chance")
    loglog.plot(diagonal, diagonal, "k--", lw=0.8)
    linear.set(
        xlabel="false positive rate", ylabel="true positive rate", title=f"{title} (linear)", xlim=(0, 1), ylim=(0, 1)
    )
    loglog.set(
        xlabel="false positive rate",
        ylabel="true positive rate",
        title=f"{title} (log-log)",
        xscale="log",
        yscale="log",
        xlim=(LOG_FLOOR, 1),
        ylim=(LOG_FLOOR, 1),
    )
    linear.legend(fontsize=7, loc="lower right")
    for ax in (linear, loglog):
        ax.grid(alpha=0.3, which="both")
    return png(fig)


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


def privacy_utility(groups: pd.DataFrame) -> bytes:
    """Final test accuracy and strongest attack AUC against the accountant's epsilon, one line per algorithm through
    its budgets (:func:`reports.summary.group_rows`). Error bars: the standard deviation over seeds for a group of
    several seeds; for a group of one run, its 95% intervals (accuracy: over the test split; AUC: simultaneous over
    its attacks)."""
    fig, (acc_ax, auc_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    epsilon = groups["epsilon_mean"].to_numpy(float)
    finite = epsilon[np.isfinite(epsilon)]
    no_dp_x = finite.max() * 1.25 if finite.size else 1.0
    x = np.where(np.isfinite(epsilon), epsilon, no_dp_x)
    for ax, column in ((acc_ax, "final_accuracy"), (auc_ax, "attack_auc")):
        for algorithm in dict.fromkeys(groups["algorithm"]):
            rows = (groups["algorithm"] == algorithm).to_numpy() & groups[f"{column}_n"].gt(0).to_numpy()
            if not rows.any():
                continue
            order = np.argsort(x[rows], kind="stable")
            mean = groups[f"{column}_mean"].to_numpy(float)[rows][order]
            std = np.nan_to_num(groups[f"{column}_std"].to_numpy(float)[rows][order])
            low = groups[f"{column}_interval_low"].to_numpy(float)[rows][order]
            high = groups[f"{column}_interval_high"].to_numpy(float)[rows][order]
            one = np.isfinite(low) & np.isfinite(high)
            below, above = np.where(one, mean - low, std), np.where(one, high - mean, std)
            line = ax.errorbar(x[rows][order], mean, yerr=[below, above], marker="o", capsize=3, label=algorithm)
            dp = np.isfinite(epsilon[rows][order])
            if not dp.all():  # no-DP points: crosses at the right edge, not joined to the DP curve
                line[0].set_data(x[rows][order][dp], mean[dp])
                ax.scatter(x[rows][order][~dp], mean[~dp], marker="x", s=60, color=line[0].get_color())
    acc_ax.set(xlabel="epsilon (x: no DP)", ylabel="final test accuracy", title="Accuracy vs epsilon")
    auc_ax.set(xlabel="epsilon (x: no DP)", ylabel="strongest attack AUC", title="Attack AUC vs epsilon")
    auc_ax.axhline(0.5, color="k", ls="--", lw=0.8)
    auc_axis(auc_ax)
    for ax in (acc_ax, auc_ax):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
        if not np.isfinite(epsilon).all():  # the no-DP column is a label, not an epsilon
            left, right = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if left <= t < no_dp_x - 0.08 * (right - left)]
            ax.set_xticks([*ticks, no_dp_x], labels=[f"{t:g}" for t in ticks] + ["no DP"])
            ax.set_xlim(left, right)
    fig.tight_layout()
    return png(fig)


def spread_caption(groups: pd.DataFrame) -> str:
    """What the error bars of :func:`privacy_utility` show, for these groups."""
    several, single = bool((groups["runs"] > 1).any()), bool((groups["runs"] == 1).any())
    seeds = "standard deviation over seeds"
    one = (
        "one seed: 95% intervals (test accuracy over the test split; the strongest attack's AUC simultaneous "
        "over its attacks)"
    )
    if several and single:
        return f"error bars: {seeds} for settings with several seeds; for settings with {one}"
    return f"error bars: {seeds}" if several else f"error bars, {one}"

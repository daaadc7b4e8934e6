"""Tables (pandas) and the machine-readable summary (summary.csv, summary.json) of a report."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import pandas as pd
import scipy.stats

from fedaudit.reports.collect import PER_CLIENT, AttackSummary, LowFprRate, ReconstructionRound, RunSummary
from fedaudit.reports.policy import Check, Policy, overall

NOT_AVAILABLE = "not available"
STRONGEST_RULE = (
    "the final-model attack whose AUC interval, simultaneous over all {compared} such attacks "
    "(Bonferroni, 95%), has the highest lower end"
)


NO_DP = "no DP"  # the epsilon (and delta) of a run trained without DP, in every table


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: a number with ``digits`` decimals (so that numbers side by side have the same precision; whole
    numbers without, very small or large ones in scientific notation), missing values as "not available"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NOT_AVAILABLE
    if isinstance(value, float):
        if math.isinf(value):
            return "infinite"
        if value.is_integer() and abs(value) < 1e6:
            return str(int(value))
        if 1e-3 <= abs(value) < 1e5:
            return f"{value:.{digits}f}"
        return f"{value:.{digits}g}"
    return str(value)


def epsilon_cell(value: Any, dp: bool) -> str:
    """An epsilon or delta cell: "no DP" for a run trained without DP (not "infinite" in one table and "not
    available" in another)."""
    return fmt(value) if dp else NO_DP


def interval(ci: tuple[float, float] | None) -> str:
    return NOT_AVAILABLE if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def rate(value: LowFprRate | None) -> str:
    """A TPR at low FPR with its interval, or why it is not estimable."""
    return NOT_AVAILABLE if value is None else str(value)


def setup_table(run: RunSummary) -> pd.DataFrame:
    return pd.DataFrame({"setting": list(run.setup), "value": [fmt(v) for v in run.setup.values()]})


def privacy_table(run: RunSummary) -> pd.DataFrame:
    """The accounting parameters of one run (empty without a ledger)."""
    p = run.privacy
    if p.client_level:
        rows = {
            "unit": "client (each client's data as a whole)",
            "accountant": p.accountant,
            "delta": p.delta,
            "noise multiplier sigma": p.noise_multiplier,
            "clipping norm C of each client's update": p.max_update_norm,
            "client sampling rate q (Poisson, by the server)": p.client_fraction,
            "clients K": p.clients,
            "rounds (each charged to every client)": p.rounds,
            "epsilon after the last round": p.epsilon if p.epsilon_per_round else None,
        }
        return pd.DataFrame({"quantity": list(rows), "value": [fmt(v, 6) for v in rows.values()]})
    rows = {
        "accountant": p.accountant,
        "delta": p.delta,
        "noise multiplier sigma": p.noise_multiplier,
        "clipping norm C": p.max_grad_norm,
        "client selection probability p": p.client_fraction,
        "q = B / N_k (worst client)": p.sample_rate,
        "DP queries per round T": p.queries_per_round,
        "worst client k (N_k records)": None
        if p.worst_client is None
        else f"{p.worst_client} ({p.worst_client_examples})",
        "rounds": p.rounds,
        "rounds the worst client took part in (each charged in full)": p.worst_client_rounds,
        "epsilon after the last round": p.epsilon if p.epsilon_per_round else None,
    }
    return pd.DataFrame({"quantity": list(rows), "value": [fmt(v, 6) for v in rows.values()]})


def epsilon_table(run: RunSummary) -> pd.DataFrame:
    eps = run.privacy.epsilon_per_round
    return pd.DataFrame({"round": range(1, len(eps) + 1), "epsilon": [fmt(e) for e in eps]})


def attack_table(attacks: tuple[AttackSummary, ...], dp: bool = True) -> pd.DataFrame:
    """One row per attack result: the numbers of its metrics.json (``dp``: whether the run was trained with DP)."""
    return pd.DataFrame(
        [
            {
                "attack": a.label,
                "round": fmt(a.round),
                "members / non-members": f"{fmt(a.num_members)} / {fmt(a.num_nonmembers)}",
                "AUC": fmt(a.auc),
                "AUC 95% interval": interval(a.auc_ci),
                "TPR at 1% FPR [95%]": rate(a.tpr_at_1pct_fpr),
                "TPR at 0.1% FPR [95%]": rate(a.tpr_at_0_1pct_fpr),
                "advantage, held-out [95%]": (
                    f"{fmt(a.advantage_held_out, 3)} {interval(a.advantage_held_out_ci)}"
                    if a.advantage_held_out_ci
                    else fmt(a.advantage_held_out)
                ),
                "epsilon lower bound (95%, this attack alone unless marked)": fmt(a.epsilon_lower_bound)
                + (
                    " (95% jointly over every canary view)"
                    if a.method == "canary" and a.epsilon_lower_bound is not None
                    else ""
                ),
                "accountant epsilon": "per record: does not bound a client"
                if dp and a.unit == "client" and a.accountant_epsilon is None
                else epsilon_cell(a.accountant_epsilon, dp),
            }
            for a in attacks
        ]
    )


VIEWS = {"update-inversion": "model update", "synthetic-nearest": "synthetic set"}
NULLS = {"random-update": "random update of the same norm", "held-out": "held-out real records"}


def mean_ci(summary: dict[str, Any], digits: int = 2) -> str:
    """ "mean [low, high] (n=N)" of an image-quality summary; without an interval (one record), the mean and n."""
    if summary.get("mean") is None:
        return NOT_AVAILABLE
    ci = summary.get("ci95")
    shown = f"{summary['mean']:.{digits}f}" + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")
    return f"{shown} (n={summary['n']})"


def recovered_cell(recovered: dict[str, Any]) -> str:
    """ "k/n = fraction [low, high]" of the records recovered at the threshold."""
    if not recovered.get("n"):
        return NOT_AVAILABLE
    ci = recovered["ci95"]
    return f"{recovered['recovered']}/{recovered['n']} = {recovered['fraction']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def reconstruction_table(rounds: tuple[ReconstructionRound, ...], dp: bool) -> pd.DataFrame:
    """One row per attacked round, every attacked client's records pooled: how close the reconstructions came, how
    many were recovered, and the same for the null that carries no record."""
    return pd.DataFrame(
        [
            {
                "round": r.round,
                "what crossed the wire": VIEWS.get(r.view, r.view),
                "clients": ", ".join(map(str, r.clients)),
                "PSNR dB [95%]": mean_ci(r.quality["psnr"]),
                "SSIM [95%]": mean_ci(r.quality["ssim"], 3),
                f"recovered (PSNR >= {r.threshold:g} dB) [95%]": recovered_cell(r.quality["recovered"]),
                "null": NULLS.get(r.null_kind, r.null_kind),
                "null PSNR dB [95%]": mean_ci(r.null_quality["psnr"]),
                "null recovered [95%]": recovered_cell(r.null_quality["recovered"]),
                "labels right": NOT_AVAILABLE if r.labels_right is None else f"{r.labels_right}/{r.labels_n}",
                "accountant epsilon": epsilon_cell(r.accountant_epsilon, dp),
            }
            for r in rounds
        ]
    )


def reconstruction_client_table(run: RunSummary) -> pd.DataFrame:
    """One row per attacked (round, client): the same numbers for each client's own records."""
    return pd.DataFrame(
        [
            {
                "round": r.round,
                "client": r.client,
                "PSNR dB [95%]": mean_ci(r.quality["psnr"]),
                "SSIM [95%]": mean_ci(r.quality["ssim"], 3),
                "recovered [95%]": recovered_cell(r.quality["recovered"]),
                "null PSNR dB [95%]": mean_ci(r.null_quality["psnr"]),
            }
            for r in run.reconstructions
        ]
    )


def client_risk_table(attack: AttackSummary) -> pd.DataFrame | None:
    """TPR at 1% and 0.1% FPR of each client's members under ``attack``'s own threshold, or None without them."""
    low, lower = attack.client_rates(0.01), attack.client_rates(0.001)
    if not low:
        return None
    return pd.DataFrame(
        [
            {
                "client": client,
                "members audited": fmt(rate.num_members),
                "TPR at 1% FPR [95%]": str(rate),
                "TPR at 0.1% FPR [95%]": str(lower[client]) if client in lower else NOT_AVAILABLE,
            }
            for client, rate in sorted(low.items(), key=lambda item: int(item[0]))
        ]
    )


def exposed_table(attack: AttackSummary) -> pd.DataFrame | None:
    """The members ``attack`` scores highest: which record, whose, which class, and the FPR that would catch it."""
    rows = (attack.risk or {}).get("most_exposed") or []
    if not rows:
        return None
    return pd.DataFrame(
        [
            {
                "record": f"{row.get('source', 'train')} {row.get('record')}",
                "client": fmt(row.get("client")),
                "class": fmt(row.get("label")),
                "score": fmt(row.get("score")),
                "caught at FPR": fmt(row.get("exposure_fpr")),
            }
            for row in rows
        ]
    )


def policy_table(checks: list[Check]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "run": c.run,
                "limit": c.limit,
                "requirement": c.requirement,
                "value": fmt(c.value),
                "verdict": c.verdict,
                "detail": c.detail,
            }
            for c in checks
        ]
    )


def group_names(runs: list[RunSummary]) -> list[str]:
    """Each run's group: runs whose configurations differ only in the seed share one, named by algorithm and budget.

    Two different settings with the same algorithm and budget (another dataset, say) get "(2)", "(3)", ... appended.
    """
    labels: dict[str, str] = {}
    settings: dict[str, int] = {}  # settings seen so far under each label (a label may itself hold " (")
    for run in runs:
        if run.seedless_config not in labels:
            taken = settings.get(run.group_label, 0)
            settings[run.group_label] = taken + 1
            labels[run.seedless_config] = run.group_label + (f" ({taken + 1})" if taken else "")
    return [labels[run.seedless_config] for run in runs]


def summary_rows(runs: list[RunSummary], checks: dict[str, list[Check]]) -> pd.DataFrame:
    """One row per run with the headline numbers (summary.csv; also the side-by-side table)."""
    rows = []
    for run, group in zip(runs, group_names(runs)):
        attack, canary = run.strongest_attack, run.strongest_canary_audit
        simultaneous = None if attack is None else attack.simultaneous_ci(run.attacks_compared)
        accuracy_ci = run.final_accuracy_ci
        bound, bound_attacks = run.epsilon_lower_bound()
        p = run.privacy
        verdicts = checks.get(run.name)
        rebuilt = run.reconstruction_rounds[-1] if run.reconstruction_rounds else None
        rows.append(
            {
                "run": run.name,
                "path": str(run.path),
                "group": group,
                "algorithm": run.setup["algorithm"],
                "budget": run.setup["privacy budget"],
                "dataset": run.setup["dataset"],
                "partition": run.setup["partition"],
                "clients": run.setup["clients"],
                "rounds": run.rounds_done,
                "seed": run.setup["seed"],
                "final_accuracy": run.final_accuracy,
                "final_accuracy_ci_low": None if accuracy_ci is None else accuracy_ci[0],
                "final_accuracy_ci_high": None if accuracy_ci is None else accuracy_ci[1],
                "test_records": run.test_records,
                "dp": p.dp,
                "unit": p.unit if p.dp and p.epsilon_per_round else None,
                "noise_multiplier": p.noise_multiplier,
                "max_grad_norm": p.max_grad_norm,
                "max_update_norm": p.max_update_norm,
                "sample_rate": p.sample_rate,
                "queries_per_round": p.queries_per_round,
                "delta": p.delta,
                "accountant": p.accountant,
                "epsilon": p.epsilon if (p.epsilon_per_round or not p.dp) else None,
                "attack": None if attack is None else attack.label,
                "attack_auc": None if attack is None else attack.auc,
                "attack_auc_ci_low": None if attack is None or attack.auc_ci is None else attack.auc_ci[0],
                "attack_auc_ci_high": None if attack is None or attack.auc_ci is None else attack.auc_ci[1],
                "attacks_compared": run.attacks_compared,
                "attack_auc_simultaneous_ci_low": None if simultaneous is None else simultaneous[0],
                "attack_auc_simultaneous_ci_high": None if simultaneous is None else simultaneous[1],
                "attack_members": None if attack is None else attack.num_members,
                "attack_nonmembers": None if attack is None else attack.num_nonmembers,
                "tpr_at_1pct_fpr": _tpr(attack, "tpr_at_1pct_fpr"),
                "tpr_at_0_1pct_fpr": _tpr(attack, "tpr_at_0_1pct_fpr"),
                "advantage_held_out": None if attack is None else attack.advantage_held_out,
                "advantage_held_out_ci_low": _side(attack, "advantage_held_out_ci", 0),
                "advantage_held_out_ci_high": _side(attack, "advantage_held_out_ci", 1),
                "epsilon_lower_bound": bound,
                "epsilon_lower_bound_attacks": bound_attacks,
                "canary_view": None if canary is None else canary.signal,
                "canary_epsilon_lower_bound": None if canary is None else canary.epsilon_lower_bound,
                "canary_auc": None if canary is None else canary.auc,
                "canary_auc_ci_low": _side(canary, "auc_ci", 0),
                "canary_auc_ci_high": _side(canary, "auc_ci", 1),
                "canary_exceeds_accountant": None if canary is None else canary.exceeds_accountant,
                **reconstruction_columns(rebuilt),
                "policy": None if verdicts is None else overall(verdicts),
            }
        )
    return pd.DataFrame(rows)


def reconstruction_columns(rebuilt: ReconstructionRound | None) -> dict[str, Any]:
    """summary.csv's reconstruction columns: the last attacked round's pooled numbers (None without a result)."""
    quality = None if rebuilt is None else rebuilt.quality
    null = None if rebuilt is None else rebuilt.null_quality

    def side(summary: dict[str, Any] | None, key: str, end: int) -> float | None:
        ci = None if summary is None else summary[key]["ci95"]
        return None if ci is None else ci[end]

    return {
        "reconstruction_round": None if rebuilt is None else rebuilt.round,
        "reconstruction_view": None if rebuilt is None else rebuilt.view,
        "reconstruction_records": None if quality is None else quality["psnr"]["n"],
        "reconstruction_psnr": None if quality is None else quality["psnr"]["mean"],
        "reconstruction_psnr_ci_low": side(quality, "psnr", 0),
        "reconstruction_psnr_ci_high": side(quality, "psnr", 1),
        "reconstruction_ssim": None if quality is None else quality["ssim"]["mean"],
        "reconstruction_recovered": None if quality is None else quality["recovered"]["fraction"],
        "reconstruction_recovered_ci_low": side(quality, "recovered", 0),
        "reconstruction_recovered_ci_high": side(quality, "recovered", 1),
        "reconstruction_threshold_db": None if rebuilt is None else rebuilt.threshold,
        "reconstruction_null_psnr": None if null is None else null["psnr"]["mean"],
        "reconstruction_null_psnr_ci_low": side(null, "psnr", 0),
        "reconstruction_null_psnr_ci_high": side(null, "psnr", 1),
        "reconstruction_epsilon": None if rebuilt is None else rebuilt.accountant_epsilon,
    }


def _side(attack: AttackSummary | None, name: str, side: int) -> float | None:
    """One end of an interval of ``attack`` (``name`` is the attribute), None where it is missing."""
    ci = None if attack is None else getattr(attack, name)
    return None if ci is None else ci[side]


def _tpr(attack: AttackSummary | None, name: str) -> float | None:
    """A TPR at low FPR of the headline attack, None where it is missing or not estimable."""
    value = None if attack is None else getattr(attack, name)
    return None if value is None or not value.estimable else value.tpr


# Headline numbers averaged over the seeds of a group, and their names in the table.
GROUPED: dict[str, str] = {
    "final_accuracy": "test accuracy",
    "epsilon": "epsilon",
    "attack_auc": "attack AUC",
    "tpr_at_0_1pct_fpr": "TPR at 0.1% FPR",
    "epsilon_lower_bound": "epsilon lower bound",
    "canary_epsilon_lower_bound": "canary audit bound",
}


def group_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Per group (see :func:`group_names`): runs, seeds, and mean, sample standard deviation and count of each
    headline number over the runs that have it (groups.csv); the policy column counts the runs that passed. A group of
    one run also carries the intervals its figure shows: its accuracy's Clopper-Pearson interval and its strongest
    attack's simultaneous AUC interval (final_accuracy_interval_low/high, attack_auc_interval_low/high)."""
    grouped = rows.groupby("group", sort=False)
    table = grouped.agg(
        algorithm=("algorithm", "first"),
        budget=("budget", "first"),
        runs=("run", "size"),
        seeds=("seed", lambda seeds: " ".join(str(s) for s in seeds)),
    )
    for column in GROUPED:
        values = pd.to_numeric(rows[column], errors="coerce").groupby(rows["group"], sort=False)
        table[f"{column}_mean"] = values.mean()
        table[f"{column}_std"] = values.std(ddof=1)
        table[f"{column}_n"] = values.count()
    single = table["runs"] == 1  # a group of one run: its intervals are its spread
    for name, source in (("attack_auc", "attack_auc_simultaneous_ci"), ("final_accuracy", "final_accuracy_ci")):
        for side in ("low", "high"):
            bound = pd.to_numeric(rows[f"{source}_{side}"], errors="coerce").groupby(rows["group"], sort=False)
            table[f"{name}_interval_{side}"] = bound.first().where(single)
    table["policy_passed"] = rows["policy"].eq("PASS").groupby(rows["group"], sort=False).sum()
    table["policy_checked"] = rows["policy"].notna().groupby(rows["group"], sort=False).sum()
    return table.reset_index()


def spread(mean: Any, std: Any, count: Any, runs: int, digits: int = 4) -> str:
    """ "mean ± std" of a group's number, with (n=k) when only k of its runs have it."""
    if not count:
        return NOT_AVAILABLE
    text = fmt(float(mean), digits)
    if count > 1 and math.isfinite(float(mean)):
        text += f" ± {fmt(float(std), 2)}"
    return text + (f" (n={int(count)})" if count < runs else "")


def group_table(groups: pd.DataFrame) -> pd.DataFrame:
    """The over-seeds table of a report, formatted for reading."""
    twice = groups.duplicated(["algorithm", "budget"], keep=False)  # two settings of one algorithm and budget
    table = pd.DataFrame(
        {
            "algorithm": groups["group"].where(twice, groups["algorithm"]),
            "privacy budget": groups["budget"],
            "runs": groups["runs"],
            "seeds": groups["seeds"],
        }
    )
    for column, title in GROUPED.items():
        table[title] = [
            NO_DP
            if column == "epsilon" and row["budget"] == NO_DP
            else spread(row[f"{column}_mean"], row[f"{column}_std"], row[f"{column}_n"], row["runs"])
            for _, row in groups.iterrows()
        ]
    if groups["policy_checked"].any():
        table["policy passed"] = [
            f"{int(p)} of {int(c)}" for p, c in zip(groups["policy_passed"], groups["policy_checked"])
        ]
    return table.map(str)


def comparison_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The side-by-side table of several runs, formatted for reading."""
    frame = frame.assign(
        accuracy_shown=[
            f"{fmt(a, 3)} {interval((lo, hi))}" if pd.notna(lo) else fmt(a)
            for a, lo, hi in zip(
                frame["final_accuracy"], frame["final_accuracy_ci_low"], frame["final_accuracy_ci_high"]
            )
        ],
        auc_shown=[
            f"{fmt(a, 3)} {interval((lo, hi))}" if pd.notna(lo) else fmt(a)
            for a, lo, hi in zip(
                frame["attack_auc"], frame["attack_auc_simultaneous_ci_low"], frame["attack_auc_simultaneous_ci_high"]
            )
        ],
        records=[f"{fmt(m)} / {fmt(n)}" for m, n in zip(frame["attack_members"], frame["attack_nonmembers"])],
        advantage_shown=[
            f"{fmt(a, 3)} {interval((lo, hi))}" if pd.notna(lo) else fmt(a)
            for a, lo, hi in zip(
                frame["advantage_held_out"], frame["advantage_held_out_ci_low"], frame["advantage_held_out_ci_high"]
            )
        ],
        canary_shown=[
            f"{fmt(b, 3)} ({view})" if isinstance(view, str) else NOT_AVAILABLE
            for b, view in zip(frame["canary_epsilon_lower_bound"], frame["canary_view"])
        ],
        canary_auc_shown=[
            f"{fmt(a, 3)} {interval((lo, hi))}" if pd.notna(lo) else fmt(a)
            for a, lo, hi in zip(frame["canary_auc"], frame["canary_auc_ci_low"], frame["canary_auc_ci_high"])
        ],
    )
    columns = {
        "run": "run",
        "algorithm": "algorithm",
        "budget": "privacy budget",
        "rounds": "rounds",
        "accuracy_shown": "test accuracy [95%]",
        "epsilon": "epsilon",
        "delta": "delta",
        "attack": "strongest attack",
        "auc_shown": "AUC [95% simultaneous]",
        "records": "members / non-members",
        "advantage_shown": "advantage, held-out [95%]",
        "epsilon_lower_bound": "epsilon lower bound (95%, simultaneous over the final attacks)",
        "canary_shown": "canary audit bound (95%, simultaneous over its views) (view)",
        "canary_auc_shown": "canary AUC [95%]",
        "policy": "policy",
    }
    if frame["policy"].isna().all():  # no policy was given
        del columns["policy"]
    if frame["canary_view"].isna().all():  # no run was audited with canaries
        del columns["canary_shown"], columns["canary_auc_shown"]
    shown = frame[list(columns)].map(lambda v: fmt(v) if not isinstance(v, bool) else str(v))
    for column in ("epsilon", "delta"):
        shown[column] = [epsilon_cell(v, bool(dp)) for v, dp in zip(frame[column], frame["dp"])]
    return shown.rename(columns=columns)


def _finite(value: Any) -> Any:
    """JSON has no infinity or NaN: infinite epsilon and missing numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def summary_json(
    runs: list[RunSummary], checks: dict[str, list[Check]], policy: Policy | None, created: str, groups: pd.DataFrame
) -> dict[str, Any]:
    """Everything the report states, as plain JSON (infinite epsilon is null with ``epsilon_infinite``)."""
    return _finite(
        {
            "format": "fedaudit-report",
            "format_version": 1,
            "created": created,
            "policy": None
            if policy is None
            else {"source": policy.source, "delta": policy.delta, "limits": policy.limits()},
            "verdict": None if policy is None else overall([c for group in checks.values() for c in group]),
            "groups": [
                {key: (value.item() if hasattr(value, "item") else value) for key, value in row.items()}
                for row in groups.to_dict("records")
            ],
            "runs": [
                {
                    "name": run.name,
                    "group": group,
                    "path": str(run.path),
                    "setup": run.setup,
                    "utility": {column: run.utility[column].tolist() for column in run.utility.columns},
                    "final_accuracy": run.final_accuracy,
                    "privacy": {
                        **asdict(run.privacy),
                        "epsilon": run.privacy.epsilon,
                        "epsilon_infinite": math.isinf(run.privacy.epsilon),
                    },
                    "attacks": [{key: value for key, value in asdict(a).items() if key != "roc"} for a in run.attacks],
                    "reconstructions": [
                        {
                            **{k: v for k, v in asdict(r).items() if k not in ("quality", "null_quality")},
                            "quality": r.quality,
                            "null_quality": r.null_quality,
                            "no_better_than_null": r.no_better_than_null,
                        }
                        for r in run.reconstruction_rounds
                    ],
                    "strongest_attack": None if run.strongest_attack is None else run.strongest_attack.name,
                    "strongest_attack_rule": STRONGEST_RULE.format(compared=run.attacks_compared),
                    "missing": [asdict(note) for note in run.notes],
                    "policy": [{k: v for k, v in asdict(c).items() if k != "run"} for c in checks.get(run.name, [])],
                }
                for run, group in zip(runs, group_names(runs))
            ],
        }
    )


def _accuracy_interval(group: pd.Series) -> tuple[float, float] | None:
    """A group's 95% interval of its accuracy: Clopper-Pearson over the test split for one run, Student's t over
    the seeds' mean for several, cut to [0, 1] (an accuracy is a fraction; with two or three seeds t's interval
    can reach below 0)."""
    if group["runs"] == 1:
        low, high = group["final_accuracy_interval_low"], group["final_accuracy_interval_high"]
        return None if pd.isna(low) else (float(low), float(high))
    n, std = int(group["final_accuracy_n"]), float(group["final_accuracy_std"])
    if n < 2 or not math.isfinite(std):
        return None
    half = float(scipy.stats.t.ppf(0.975, n - 1)) * std / math.sqrt(n)
    mean = float(group["final_accuracy_mean"])
    return max(0.0, mean - half), min(1.0, mean + half)


def _fedlap_below(rows: pd.DataFrame, below: list[str], apart: list[str]) -> str:
    """Where FedLAP-DP ranks below DP-FedAvg, against the paper's ordering, and why in this study's terms."""
    if apart:
        where = f"At {', '.join(apart)} FedLAP-DP is below DP-FedAvg with the intervals apart"
        if len(below) > len(apart):
            rest = [b for b in below if b not in apart]
            where += f" (and its mean is below at {', '.join(rest)}, where the intervals overlap)"
    else:
        where = (
            f"FedLAP-DP's mean accuracy is below DP-FedAvg's at {', '.join(below)}, though the intervals overlap, so "
            "this study cannot confirm the order"
        )
    lap = rows[rows["algorithm"] == "FedLAP-DP"] if "algorithm" in rows else rows.iloc[:0]
    rates = lap["sample_rate"].dropna() if "sample_rate" in lap else pd.Series(dtype=float)
    rate = f"samples q = {fmt(float(rates.max()))} of a client's records (B / N_k)" if len(rates) else "samples more"
    return (
        f"{where}: the opposite of the ordering the FedLAP-DP paper reports at small epsilon. The paper measured it "
        "on Fashion-MNIST and CIFAR-10, with about 10,000 records per client, where each of FedLAP-DP's noisy "
        f"real-gradient queries samples about 2% of them; here a query {rate}, so the gradients its synthetic sets "
        "are matched to average fewer records and their noise weighs more against their signal."
    )


def _ordering(budget: str, part: pd.DataFrame) -> tuple[str, bool, bool]:
    """The accuracy ordering of the groups at one budget, in one sentence with their intervals; whether FedLAP-DP
    ranks below a DP-FedAvg setting at an equal or larger epsilon, and whether with the intervals apart."""
    ranked = part.sort_values("final_accuracy_mean", ascending=False)
    twice = ranked["algorithm"].duplicated(keep=False)  # two settings of one algorithm: named by their group
    # a budget set by sigma is not one epsilon: each algorithm's own is stated, and orderings judged by it
    by_sigma = budget.startswith("sigma")
    shown = [
        (
            row["group"] if is_twice else row["algorithm"],
            float(row["final_accuracy_mean"]),
            _accuracy_interval(row),
            float(row["epsilon_mean"]) if by_sigma and pd.notna(row["epsilon_mean"]) else None,
        )
        for (_, row), is_twice in zip(ranked.iterrows(), twice)
    ]
    text = " > ".join(
        f"{name} {fmt(mean)} {interval(ci)}" + ("" if eps is None else f" at epsilon {fmt(eps)}")
        for name, mean, ci, eps in shown
    )
    apart = all(a is not None and b is not None and a[0] > b[1] for (_, _, a, _), (_, _, b, _) in zip(shown, shown[1:]))
    verdict = (
        "every interval apart from the next" if apart else "some intervals overlap, so this study cannot order those"
    )
    algorithms = list(ranked["algorithm"])
    # below at a smaller epsilon is no evidence against the paper's ordering at equal epsilon
    pairs = [
        (shown[i], shown[j])
        for i, lap_name in enumerate(algorithms)
        if lap_name == "FedLAP-DP"
        for j, avg_name in enumerate(algorithms[:i])
        if avg_name == "DP-FedAvg" and (shown[i][3] is None or shown[j][3] is None or shown[i][3] >= 0.99 * shown[j][3])
    ]
    lap_apart = any(lap is not None and avg is not None and lap[1] < avg[0] for (*_, lap, _), (*_, avg, _) in pairs)
    return f"Test accuracy at {budget}: {text} (95% intervals; {verdict}).", bool(pairs), lap_apart


def findings(rows: pd.DataFrame, groups: pd.DataFrame) -> list[str]:
    """What a study's comparison shows, each in one sentence with its intervals: the ordering of the algorithms at each
    privacy budget, whether it is the FedLAP-DP paper's, and whether the attacks can tell DP from no DP at this size."""
    sentences = []
    if "dataset" in rows and rows["dataset"].nunique() > 1:
        by_dataset = rows.groupby("dataset", sort=False)["run"].apply(lambda names: ", ".join(map(str, names)))
        sentences.append(
            "These runs were trained on different datasets ("
            + "; ".join(f"{dataset}: {names}" for dataset, names in by_dataset.items())
            + "): their accuracies and attack figures measure different tasks and are not compared here as if "
            "they were one study."
        )
    budgets = [str(b) for b in groups["budget"]] if "budget" in groups else []
    if any(b.endswith(PER_CLIENT) for b in budgets) and any(
        b != "no DP" and not b.endswith(PER_CLIENT) and "label DP" not in b for b in budgets
    ):
        sentences.append(
            "These runs protect two units: an epsilon per client bounds what the models reveal about a client's whole "
            "data, an epsilon per record about one of its records, so each budget is compared within its own unit "
            "(the figures put both on one epsilon axis as numbers only)."
        )
    below: list[str] = []  # budgets where FedLAP-DP's mean accuracy is below DP-FedAvg's
    separated: list[str] = []  # ... with the two intervals apart
    for budget, part in groups.groupby("budget", sort=False):
        part = part[part["final_accuracy_n"] > 0]
        if part["algorithm"].nunique() < 2:
            continue
        sentence, lap_below, lap_apart = _ordering(str(budget), part)
        sentences.append(sentence)
        below += [str(budget)] if lap_below else []
        separated += [str(budget)] if lap_apart else []
    if below:
        sentences.append(_fedlap_below(rows, below, separated))
    dp_rows, plain_rows = rows[rows["dp"].astype(bool)], rows[~rows["dp"].astype(bool)]
    plain_rows = plain_rows[plain_rows["attack_auc"].notna()]
    if len(dp_rows) and len(plain_rows):
        leaking = plain_rows["attack_auc_simultaneous_ci_low"] > 0.5
        if not leaking.any():
            strongest = plain_rows.loc[pd.to_numeric(plain_rows["attack_auc"]).idxmax()]
            auc = float(strongest["attack_auc"])
            members = int(min(plain_rows["attack_members"].min(), plain_rows["attack_nonmembers"].min()))
            if auc > 0.5:
                # the interval judged above holds for all the run's attacks at once: its z, not 1.96; the AUC's
                # variance near 0.5 is about 1 / (6 n) with n members and n non-members (Hanley and McNeil)
                compared = max(1, int(strongest.get("attacks_compared") or 1))
                z = float(scipy.stats.norm.ppf(1.0 - 0.05 / (2 * compared)))
                needed = math.ceil((z / (auc - 0.5)) ** 2 / 6.0)
                tail = (
                    f"showing the no-DP runs' largest AUC, {fmt(auc)}, above 0.5 at 95% would take about "
                    f"{needed} members and as many non-members (these attacks had {members})"
                )
            else:
                tail = f"their AUC is at most 0.5 with {members} members and as many non-members"
            sentences.append(
                "No attack on a run without DP shows leakage beyond chance (every AUC interval contains 0.5), so this "
                f"study cannot tell DP from no DP by its attacks: {tail}."
            )
    return sentences

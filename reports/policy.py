"""Compliance policies: limits read from YAML, checked against each run's summary.

Measured quantities (attack AUC, TPR at low FPR, test accuracy) are judged on
their 95% intervals, not on point estimates: a limit is met (PASS) when the
whole interval is on the right side of it, broken (FAIL) when the whole interval
is on the wrong side, and INCONCLUSIVE when the interval straddles it or the
sample cannot measure the quantity at all (a TPR at 0.1% FPR from fewer than
1000 non-members in each half of the evaluation set). An inconclusive verdict says about how many records would
resolve it. The accountant's epsilon is exact, so it only passes or fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedaudit.config import YAMLRefused, load_yaml, read_small_text
from fedaudit.reports.collect import LowFprRate, ReportError, RunSummary

LIMITS: dict[str, str] = {
    "max_epsilon": "accountant's epsilon after the last round <= {limit:g} at delta {delta}",
    "max_attack_auc": "AUC of every attack on the final model <= {limit:g} (judged on its 95% interval)",
    "max_tpr_at_0_1pct_fpr": (
        "TPR at 0.1% FPR of every attack on the final model <= {limit:g} (judged on its 95% interval)"
    ),
    "max_tpr_at_1pct_fpr_per_client": (
        "TPR at 1% FPR of every client's members, for every attack on the final model, <= {limit:g} (judged on its "
        "95% interval)"
    ),
    "min_accuracy": "final test accuracy >= {limit:g} (judged on its 95% interval)",
    "max_audit_ratio": "canary audit's epsilon lower bound <= {limit:g} x the accountant's epsilon (the bound holds "
    "at 95%; above 1, the DP implementation or its accounting is broken)",
    "max_failed_conformance_checks": "conformance checks of `fedaudit verify` that fail <= {limit:g} (noise, "
    "clipping, sampling, the ledger recomputed with dp-accounting)",
    "max_reconstruction_psnr": "mean PSNR of the records reconstructed from what crossed the wire in every attacked "
    "round <= {limit:g} dB (judged on its 95% interval over the round's records)",
}
OPTIONS = ("delta",)
# The values each key may take, as (low, high, low included, high included, the range in words): a limit outside
# them cannot mean what it says (an AUC above 1 passes everything, an epsilon of -1 fails everything).
RANGES: dict[str, tuple[float, float, bool, bool, str]] = {
    "max_epsilon": (0.0, math.inf, False, False, "a positive number"),
    "delta": (0.0, 1.0, False, False, "between 0 and 1, both excluded"),
    "max_attack_auc": (0.5, 1.0, True, True, "between 0.5 (chance) and 1"),
    "max_tpr_at_0_1pct_fpr": (0.0, 1.0, True, True, "a rate between 0 and 1"),
    "max_tpr_at_1pct_fpr_per_client": (0.0, 1.0, True, True, "a rate between 0 and 1"),
    "min_accuracy": (0.0, 1.0, True, True, "an accuracy between 0 and 1"),
    "max_audit_ratio": (0.0, math.inf, True, False, "a non-negative ratio"),
    "max_failed_conformance_checks": (0.0, math.inf, True, False, "a non-negative count"),
    "max_reconstruction_psnr": (0.0, math.inf, False, False, "a positive number of dB"),
}

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
# Exit codes of `fedaudit report` / `compare` with a policy (2 stays reserved for bad input).
EXIT_CODES: dict[str, int] = {PASS: 0, FAIL: 1, INCONCLUSIVE: 3}


@dataclass(frozen=True)
class Policy:
    """Limits a run must meet; None means the limit is not set."""

    max_epsilon: float | None = None
    delta: float | None = None
    max_attack_auc: float | None = None
    max_tpr_at_0_1pct_fpr: float | None = None
    max_tpr_at_1pct_fpr_per_client: float | None = None
    min_accuracy: float | None = None
    max_audit_ratio: float | None = None
    max_failed_conformance_checks: float | None = None
    max_reconstruction_psnr: float | None = None
    source: str = ""

    def limits(self) -> dict[str, float]:
        """The limits that are set, by name."""
        return {name: getattr(self, name) for name in LIMITS if getattr(self, name) is not None}


@dataclass(frozen=True)
class Check:
    """One limit checked on one run: PASS, FAIL, or INCONCLUSIVE when the sample cannot tell which."""

    run: str
    limit: str
    requirement: str
    value: float | None
    verdict: str
    detail: str

    @property
    def passed(self) -> bool:
        return self.verdict == PASS


def overall(checks: list[Check]) -> str:
    """FAIL if any check failed, else INCONCLUSIVE if any was inconclusive, else PASS."""
    verdicts = {c.verdict for c in checks}
    return FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS


def read_yaml(file: Path, what: str, error: type[ReportError] = ReportError) -> Any:
    """The content of a YAML file (safe types, no aliases, bounded size and nesting: fedaudit.config.load_yaml);
    unreadable, too large or malformed is one sentence naming ``what`` it is."""
    try:
        text = read_small_text(file, what)
    except ValueError as exc:
        raise error(str(exc)) from exc
    try:
        return load_yaml(text)
    except RecursionError as exc:
        raise error(f"The {what} {file} nests deeper than fedaudit reads.") from exc
    except YAMLRefused as exc:
        raise error(f"The {what} {file} {exc}.") from exc
    except yaml.YAMLError as exc:
        raise error(f"The {what} {file} is not valid YAML.") from exc


COUNTS = frozenset({"max_failed_conformance_checks"})  # limits that count something: whole numbers only


def load_policy(path: str | Path) -> Policy:
    """Read a YAML policy; unknown keys and non-numeric limits are a :class:`ReportError`."""
    file = Path(path)
    data = read_yaml(file, "policy file")
    if not isinstance(data, dict) or not data:
        raise ReportError(f"The policy file {file} must be a YAML mapping of limits such as max_epsilon: 8.")
    known = (*LIMITS, *OPTIONS)
    values: dict[str, float] = {}
    for key, value in data.items():
        if key not in known:
            raise ReportError(f"Unknown limit {key!r} in the policy file {file}; use {', '.join(known)}.")
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError, OverflowError):  # a 400-digit whole number overflows a float
            raise ReportError(f"The limit {key} in the policy file {file} must be a number, got {value!r}.") from None
        if math.isnan(number):
            raise ReportError(f"The limit {key} in the policy file {file} must be a number, got {value!r}.")
        low, high, low_in, high_in, words = RANGES[key]
        if key in COUNTS and not number.is_integer():
            raise ReportError(f"The limit {key} in the policy file {file} must be {words}, got {value!r}.")
        above = number > low or (low_in and number == low)
        below = number < high or (high_in and number == high)
        if not (above and below):
            raise ReportError(f"The limit {key} in the policy file {file} must be {words}, got {value!r}.")
        values[key] = number
    if not any(key in LIMITS for key in values):
        raise ReportError(f"The policy file {file} sets no limit; use {', '.join(LIMITS)}.")
    if "delta" in values and "max_epsilon" not in values:  # it would be ignored without a word
        raise ReportError(f"The policy file {file} sets delta, which qualifies max_epsilon alone: add max_epsilon.")
    return Policy(**values, source=str(file))


def check_run(policy: Policy, run: RunSummary) -> list[Check]:
    """Check every limit of ``policy`` on ``run``; a value that is not available fails its limit."""
    checks = []
    if run.integrity:
        checks.append(
            Check(run.name, "integrity", "the run's files are those fedaudit wrote", None, FAIL, run.integrity[0])
        )
    for name, limit in policy.limits().items():
        requirement = LIMITS[name].format(
            limit=limit, delta="of the run" if policy.delta is None else f"{policy.delta:g}"
        )
        value, verdict, detail = _CHECKS[name](policy, run, limit)
        checks.append(Check(run.name, name, requirement, value, verdict, detail))
    return checks


def judge(interval: tuple[float, float], limit: float, *, at_most: bool) -> str:
    """Verdict on "the true value is at most (or, with ``at_most=False``, at least) ``limit``" from a 95% interval:
    PASS when the whole interval is on the allowed side, FAIL when it is entirely on the other, else INCONCLUSIVE."""
    low, high = interval
    if at_most:
        return PASS if high <= limit else FAIL if low > limit else INCONCLUSIVE
    return PASS if low >= limit else FAIL if high < limit else INCONCLUSIVE


def records_needed(
    n: int | None, interval: tuple[float, float], estimate: float, limit: float, *, proportion: bool = False
) -> int | None:
    """About how many records would shrink the interval until it no longer straddles ``limit``; None when the
    estimate sits on the limit or n is unknown. For a proportion (its two-sided 95% Clopper-Pearson interval, as the
    report shows it) the fewest records whose interval at the same rate excludes the limit, found by search: near 0
    or 1 that interval is far from symmetric and its width falls as 1/n, not 1/sqrt(n). Otherwise from the side of
    the interval that faces the limit, which scales as 1/sqrt(n)."""
    if not n or estimate == limit:
        return None
    if proportion:
        return _proportion_records(n, estimate, limit)
    side = interval[1] - estimate if limit > estimate else estimate - interval[0]
    return max(n + 1, math.ceil(n * (side / abs(estimate - limit)) ** 2))


def _proportion_records(n: int, rate: float, limit: float) -> int | None:
    """The fewest m > n whose two-sided 95% Clopper-Pearson interval at ``rate`` (rate m successes, not rounded, so
    that the interval narrows steadily with m) lies wholly on the rate's side of ``limit``: doubled until one does,
    then halved between (None beyond 10^9 records)."""
    from scipy.stats import beta

    def resolves(m: int) -> bool:
        k = rate * m
        if rate < limit:
            return k < m and float(beta.ppf(0.975, k + 1, m - k)) < limit
        return k > 0 and float(beta.ppf(0.025, k, m - k + 1)) > limit

    fails, works = n, 2 * n
    while not resolves(works):
        fails, works = works, 2 * works
        if works > 10**9:
            return None
    while works - fails > 1:
        middle = (fails + works) // 2
        fails, works = (fails, middle) if resolves(middle) else (middle, works)
    return works


def _resolution(needed: int | None, unit: str) -> str:
    """What an inconclusive detail adds: the records that would resolve it, or that the estimate sits on the limit."""
    return " (the estimate sits on the limit)" if needed is None else f" (about {needed} {unit} would resolve it)"


def _judged(
    estimate: float,
    interval: tuple[float, float],
    limit: float,
    n: int | None,
    detail: str,
    *,
    at_most: bool = True,
    unit: str = "per side",
    proportion: bool = False,
) -> tuple[str, float, str]:
    """(verdict, value, detail) of one interval against one limit; an inconclusive detail says what would resolve it
    (``proportion``: the interval is a rate's Clopper-Pearson interval)."""
    verdict = judge(interval, limit, at_most=at_most)
    if verdict == INCONCLUSIVE:
        detail += _resolution(records_needed(n, interval, estimate, limit, proportion=proportion), unit)
    return verdict, estimate, detail


def _worst(results: list[tuple[str, float | None, str]]) -> tuple[float | None, str, str]:
    """Combine per-attack (verdict, value, detail): a FAIL decides, then an INCONCLUSIVE, else PASS."""
    for verdict in (FAIL, INCONCLUSIVE, PASS):
        chosen = [r for r in results if r[0] == verdict]
        if chosen:
            values = [r[1] for r in chosen if r[1] is not None]
            return (max(values) if values else None), verdict, "; ".join(r[2] for r in chosen)
    return None, FAIL, "not available"


def _epsilon(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, str, str]:
    privacy = run.privacy
    if not privacy.dp:
        return math.inf, FAIL, "no DP guarantee: epsilon is infinite"
    if not privacy.epsilon_per_round:
        return None, FAIL, "not available: the privacy ledger is missing"
    eps = privacy.epsilon
    if policy.delta is not None and privacy.delta is None:
        return (
            eps,
            FAIL,
            f"the run's delta is not recorded, so it cannot be compared with the policy's delta {policy.delta:g}",
        )
    if policy.delta is not None and privacy.delta > policy.delta:
        return eps, FAIL, f"accounted at delta {privacy.delta:g}, larger than the policy's delta {policy.delta:g}"
    delta = "not recorded" if privacy.delta is None else f"{privacy.delta:g}"
    return eps, PASS if eps <= limit else FAIL, f"epsilon {eps:.4g} at delta {delta}"


def _auc(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, str, str]:
    """PASS when every attack's 95% interval is at or below the limit; FAIL only when some attack's interval that is
    simultaneous over all of them (Bonferroni) lies above it, so that checking K attacks does not multiply the chance of
    a false FAIL by K; else INCONCLUSIVE."""
    attacks = [a for a in run.final_attacks if a.auc is not None and a.auc_ci is not None]
    results = []
    for a in attacks:
        simultaneous = (a.simultaneous_ci(len(attacks)) if len(attacks) > 1 else None) or a.auc_ci
        own, joint = judge(a.auc_ci, limit, at_most=True), judge(simultaneous, limit, at_most=True)
        verdict = PASS if own == PASS else FAIL if joint == FAIL else INCONCLUSIVE
        value = a.auc
        detail = (
            f"{a.label}: AUC {a.auc:.4f} [{a.auc_ci[0]:.4f}, {a.auc_ci[1]:.4f}], n={a.num_members}/{a.num_nonmembers}"
        )
        if own == FAIL and verdict != FAIL:
            detail += (
                f" (above the limit, but not with its interval simultaneous over the {len(attacks)} attacks, "
                f"[{simultaneous[0]:.4f}, {simultaneous[1]:.4f}])"
            )
        if verdict == INCONCLUSIVE:  # a FAIL is judged on the simultaneous interval, a PASS on the attack's own
            facing = simultaneous if a.auc > limit else a.auc_ci
            detail += _resolution(records_needed(a.num_members, facing, a.auc, limit), "per side")
        results.append((verdict, value, detail))
    if not results:
        return None, FAIL, "not available: no attack results with an AUC interval" + _stale(run)
    return _worst(results)


def _stale(run: RunSummary) -> str:
    """Why a run's attack results do not count, when they were made on an earlier final model (the run was attacked,
    then trained further): the rounds they saw and the command that brings them up to date."""
    earlier = sorted({a.round for a in run.attacks if a.round is not None and a.round < run.rounds_done})
    if not earlier or run.final_attacks:
        return ""
    seen = ", ".join(map(str, earlier))
    return (
        f" on its final model: the results under attacks/ are of round {seen}, and the run has {run.rounds_done} "
        f"rounds now; run `fedaudit attack {run.path}` again"
    )


def _rate_verdict(rate: LowFprRate, limit: float, where: str) -> tuple[str, float | None, str]:
    """(verdict, value, detail) of one TPR at low FPR against ``limit``: INCONCLUSIVE when the sample cannot measure
    it, FAIL without an interval, else judged on its interval."""
    if rate.off_target:
        return INCONCLUSIVE, None, f"{where}: not estimable ({rate.reason})"
    if not rate.estimable:
        return (
            INCONCLUSIVE,
            None,
            f"{where}: not estimable from {rate.num_nonmembers} non-members per half ({rate.target:.1%} FPR needs "
            f"at least {rate.nonmembers_needed} in each half of the evaluation set)",
        )
    if rate.tpr is None or rate.ci is None:
        return FAIL, rate.tpr, f"{where}: no interval recorded; re-run fedaudit attack"
    detail = f"{where}: {rate}, n={rate.num_members} members"
    return _judged(rate.tpr, rate.ci, limit, rate.num_members, detail, proportion=True)


def _tpr(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, str, str]:
    results = [
        _rate_verdict(a.tpr_at_0_1pct_fpr, limit, a.label) for a in run.final_attacks if a.tpr_at_0_1pct_fpr is not None
    ]
    if not results:
        return None, FAIL, "not available: no attack results with TPR at 0.1% FPR" + _stale(run)
    return _worst(results)


def _tpr_per_client(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, str, str]:
    """Each client's TPR at 1% FPR, each attack on the final model: the worst verdict over every (attack, client)."""
    results = [
        _rate_verdict(rate, limit, f"{a.label}, client {client}")
        for a in run.final_attacks
        for client, rate in a.client_rates(0.01).items()
    ]
    if not results:
        return None, FAIL, "not available: no attack results with per-client TPR (re-run fedaudit attack)" + _stale(run)
    return _worst(results)


def _accuracy(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, str, str]:
    accuracy = run.final_accuracy
    if accuracy is None:
        return None, FAIL, "not available: metrics.csv has no test accuracy"
    interval = run.final_accuracy_ci
    if interval is None:
        return accuracy, PASS if accuracy >= limit else FAIL, f"{accuracy:.4f} (test split size not recorded)"
    verdict, _, detail = _judged(
        accuracy,
        interval,
        limit,
        run.test_records,
        f"{accuracy:.4f} [{interval[0]:.4f}, {interval[1]:.4f}] on {run.test_records} test records",
        at_most=False,
        unit="test records",
        proportion=True,
    )
    return accuracy, verdict, detail


def _audit(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, str, str]:
    """The canary audit's bound is itself a 95% statement: above ``limit`` times the accountant's epsilon is a FAIL."""
    audits = [a for a in run.canary_audits if a.epsilon_lower_bound is not None and a.accountant_epsilon]
    if not audits:
        return None, FAIL, "not available: no canary audit (train with --dp --canaries N, attack with --method canary)"
    results = []
    for a in audits:
        ratio = a.epsilon_lower_bound / a.accountant_epsilon
        detail = f"{a.label}: bound {a.epsilon_lower_bound:.4g} vs the accountant's {a.accountant_epsilon:.4g}"
        results.append((PASS if ratio <= limit else FAIL, ratio, f"{detail} (ratio {ratio:.3g})"))
    return _worst(results)


def _conformance(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, str, str]:
    """The conformance checks are exact verdicts (each a test at a family-wise level of 0.001): more failures than
    ``limit`` is a FAIL, and a run that was not verified as it stands cannot meet the limit."""
    verification = run.verification
    if verification is None or not verification.current:
        state = "not verified" if verification is None else "verified at another round"
        trained = "--save-transmitted" if run.privacy.client_level else "--canaries"
        return None, FAIL, f"not available: {state} (run `fedaudit verify` on a run trained with {trained})"
    failed = len(verification.failed)
    names = ", ".join(c.name for c in verification.failed) or "none"
    detail = f"{failed} of {len(verification.checks)} failed: {names}"
    unmade = [c.name for c in verification.checks if not c.checked]
    if unmade and failed <= limit:  # a check never made is not a check passed
        return float(failed), FAIL, f"{detail}; not made: {', '.join(unmade)} (see the run's conformance section)"
    return float(failed), PASS if failed <= limit else FAIL, detail


def _reconstruction(policy: Policy, run: RunSummary, limit: float) -> tuple[float | None, str, str]:
    """Each attacked round's mean PSNR, its clients' records pooled, judged on its 95% interval: the worst verdict
    over the rounds. One record has no interval, so it cannot decide (INCONCLUSIVE)."""
    rounds = run.reconstruction_rounds
    if not rounds:
        return (
            None,
            FAIL,
            f"not available: no reconstruction results (run `fedaudit attack {run.path} --method reconstruction` on "
            "a run trained with --save-transmitted)",
        )
    results = []
    for r in rounds:
        psnr = r.quality["psnr"]
        where = f"round {r.round} ({len(r.clients)} client{'s' * (len(r.clients) != 1)})"
        if psnr["ci95"] is None:
            results.append(
                (
                    INCONCLUSIVE,
                    psnr["mean"],
                    f"{where}: PSNR {psnr['mean']:.2f} dB from one record, which has no interval",
                )
            )
            continue
        low, high = psnr["ci95"]
        results.append(
            _judged(
                psnr["mean"],
                (low, high),
                limit,
                psnr["n"],
                f"{where}: PSNR {psnr['mean']:.2f} dB [{low:.2f}, {high:.2f}], n={psnr['n']} records",
                unit="records",
            )
        )
    return _worst(results)


_CHECKS = {
    "max_epsilon": _epsilon,
    "max_tpr_at_1pct_fpr_per_client": _tpr_per_client,
    "max_attack_auc": _auc,
    "max_tpr_at_0_1pct_fpr": _tpr,
    "min_accuracy": _accuracy,
    "max_audit_ratio": _audit,
    "max_failed_conformance_checks": _conformance,
    "max_reconstruction_psnr": _reconstruction,
}

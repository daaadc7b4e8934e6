"""The verdict block at the top of every report: per run, one sentence saying what the run promises, what the
attacks showed and whether its implementation and files check, with a status, and what was not shown.

The status is FAIL for a run whose files are not those fedaudit wrote, whose DP implementation fails a check, or
whose attacks prove more than the accountant allows; otherwise the policy's verdict for the run (PASS, FAIL,
INCONCLUSIVE), or NO POLICY when none was given. A reviewer reads this block first; every number in it is in the
run's own section below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedaudit.reports.collect import RunSummary
from fedaudit.reports.summary import fmt

NO_POLICY = "NO POLICY"


@dataclass(frozen=True)
class RunVerdict:
    """One run's line of the verdict block."""

    run: str
    status: str
    sentence: str
    not_shown: tuple[str, ...]


def run_verdict(
    run: RunSummary, promise: dict[str, Any] | None, exceeds: dict[str, Any] | None, policy_verdict: str | None
) -> RunVerdict:
    """The verdict line of ``run``; ``promise`` and ``exceeds`` as the run's section computes them, ``policy_verdict``
    the policy's verdict for this run (None without a policy)."""
    not_shown: list[str] = []
    broken = bool(run.integrity) or exceeds is not None or (promise is not None and promise["verdict"] == "FAIL")
    parts = [f"{run.setup['algorithm']} {_promises(run)}"]
    parts.append(_attacks(run, exceeds, not_shown))
    if run.reconstruction_rounds:
        parts.append(_reconstruction(run))
    if promise is not None:
        parts.append(_implementation(promise, not_shown))
    sentence = "; ".join(parts) + "."
    if run.integrity:
        sentence = (
            f"Its files are not those fedaudit wrote ({run.integrity[0]}), so nothing reported about it can be "
            f"trusted. {sentence}"
        )
    status = "FAIL" if broken else (policy_verdict or NO_POLICY)
    return RunVerdict(run.name, status, sentence[0].upper() + sentence[1:], tuple(not_shown))


def _promises(run: RunSummary) -> str:
    privacy = run.privacy
    if privacy.dp and privacy.epsilon_per_round:
        delta = "an unrecorded delta" if privacy.delta is None else f"delta {privacy.delta:g}"
        return (
            f"promises epsilon {fmt(privacy.epsilon)} at {delta} per {privacy.unit_words} after {run.rounds_done} "
            "rounds"
        )
    if privacy.dp:
        return "was trained with DP, but its ledger privacy.json is missing, so no epsilon is stated"
    budget = str(run.setup.get("privacy budget", ""))
    if "label DP" in budget:
        return f"promises only {budget}, no record-level guarantee"
    return "promises no differential privacy"


def _attacks(run: RunSummary, exceeds: dict[str, Any] | None, not_shown: list[str]) -> str:
    strongest, canary = run.strongest_attack, run.strongest_canary_audit
    if exceeds is not None:
        return (
            f"an attack proved more: {exceeds['attack']} shows epsilon ≥ {fmt(exceeds['bound'])} (95%), above the "
            f"accountant's {fmt(exceeds['accountant'])}"
        )
    if strongest is None and canary is None:
        not_shown.append(
            f"membership inference: no attack results for the final model (run `fedaudit attack {run.path}`)"
        )
        return "no attack was run on its final model"
    pieces = []
    if strongest is not None:
        compared = run.attacks_compared
        joint = strongest.simultaneous_ci(compared)
        ci = "" if joint is None else f" [{fmt(joint[0])}, {fmt(joint[1])}]"
        if compared > 1 and joint is not None:
            ci += f" (95% over all {compared})"
        who = f"the strongest of {compared} attacks" if compared > 1 else "the one attack"
        pieces.append(f"{who}, {strongest.label}, reaches AUC {fmt(strongest.auc)}{ci}")
    if canary is not None:
        pieces.append(f"the canary audit proves epsilon ≥ {fmt(canary.epsilon_lower_bound)} (95%)")
    if not (run.privacy.dp and run.privacy.epsilon_per_round):  # no accountant's epsilon to hold them against
        return ", ".join(pieces)
    bound, count = run.epsilon_lower_bound()
    if bound is not None:
        pieces.append(f"the attacks prove epsilon ≥ {fmt(bound)} (95% over {count})")
    return "no attack showed more than the accountant: " + ", ".join(pieces)


def _reconstruction(run: RunSummary) -> str:
    """What the reconstruction audit rebuilt, in the round where it came closest."""
    worst = max(run.reconstruction_rounds, key=lambda r: r.quality["psnr"]["mean"] or 0.0)
    recovered, psnr = worst.quality["recovered"], worst.quality["psnr"]
    ci = "" if psnr["ci95"] is None else f" [{fmt(psnr['ci95'][0], 2)}, {fmt(psnr['ci95'][1], 2)}]"
    null = "no better than its null" if worst.no_better_than_null else "better than its null"
    if worst.no_better_than_null is None:
        null = f"against {fmt(worst.null_quality['psnr']['mean'], 2)} dB for its null"
    if worst.view == "synthetic-nearest":
        return (
            f"of the synthetic images sent in round {worst.round}, {recovered['recovered']} of {recovered['n']} reach "
            f"a PSNR of {fmt(worst.threshold)} dB or more against their client's nearest record (mean "
            f"{fmt(psnr['mean'], 2)} dB{ci}, {null})"
        )
    return (
        f"from what crossed the wire in round {worst.round} the server could rebuild {recovered['recovered']} of "
        f"{recovered['n']} records at {fmt(worst.threshold)} dB or more (mean PSNR {fmt(psnr['mean'], 2)} dB{ci}, "
        f"{null})"
    )


def _implementation(promise: dict[str, Any], not_shown: list[str]) -> str:
    if promise["verdict"] == "FAIL":
        return f"the implementation checks failed ({promise['failures'][0]})"
    not_shown += promise["unchecked"]
    if promise["verdict"] == "PASS":
        return "the implementation checks passed"
    return "the implementation was not fully checked"

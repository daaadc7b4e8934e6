"""Read run directories into the summary model that the figures, policy and renderers use."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from safetensors import SafetensorError
from safetensors.numpy import load_file
from scipy.stats import norm

from fedaudit.attacks.metrics import rate_interval, threshold_bounds
from fedaudit.attacks.reconstruction.image_quality import quality_summary
from fedaudit.attacks.registry import RECONSTRUCTION_METHOD
from fedaudit.config import PrivacyConfig, RunConfig, secure_aggregation
from fedaudit.errors import UserError
from fedaudit.privacy.accounting import AccountingError, PrivacyLedger
from fedaudit.privacy.randomness import CLIENT_SECRETS, NOISE_SEED, RUN_SEED
from fedaudit.registry import ALGORITHMS, WIRE_SYNTHETIC, AlgorithmEntry, algorithm_label
from fedaudit.rundir import AttackRecord, Manifest, RateRecord, RunDirectory, RunError, bounded_size

SYNTHETIC_ROUNDS = 6  # stored rounds of synthetic images shown in a report at most
ATTACK_HINT = "run `fedaudit attack {path}` (add `--target all` for the AUC after every round)"
CHANGED_NOTE = "The attack result {name} was changed after fedaudit wrote it (see the integrity check) and is left out."


class ReportError(UserError):
    """Bad input to ``fedaudit report`` (one clear sentence)."""


class TamperedRunError(ReportError):
    """A run whose files are not those fedaudit wrote, and which cannot even be laid out: its integrity FAIL, in one
    sentence and with the exit code of any FAIL (1)."""

    exit_code = 1

    def __init__(self, path: Path, problems: Sequence[str], reason: BaseException) -> None:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        why = str(reason).strip().rstrip(".")
        if not isinstance(reason, UserError):  # a library's exception on the edited content: name its kind
            why = f"{type(reason).__name__}: {why}" if why else type(reason).__name__
        super().__init__(
            f"{path}: FAIL: its files are not those fedaudit wrote: {problems[0]}{more}; and it cannot be laid out "
            f"({why}), so no report was written."
        )


@dataclass(frozen=True)
class Note:
    """Something the report could not show, and how to produce it."""

    what: str
    how: str


@dataclass(frozen=True)
class PrivacySummary:
    """The accountant's guarantee of a run (None fields: not recorded)."""

    dp: bool
    accountant: str | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    max_grad_norm: float | None = None
    sample_rate: float | None = None
    queries_per_round: int | None = None
    client_fraction: float | None = None
    worst_client_rounds: int | None = None
    batch_size: int | None = None
    worst_client: int | None = None
    worst_client_examples: int | None = None
    rounds: int | None = None
    epsilon_per_round: tuple[float, ...] = ()
    unit: str = "record"  # what epsilon protects: one record, or one client's data as a whole (--dp-level client)
    max_update_norm: float | None = None  # client level: the clipping norm of each client's update
    clients: int | None = None  # client level: the clients, each a unit of the guarantee
    noise_at: str = "server"  # client level: who added the noise: the server, or the clients in shares
    secure_sum: bool = False  # with the noise in shares: the server received the shares only summed (SecAgg+)

    @property
    def noise_in_shares(self) -> bool:
        """Whether, at client level, each client added its share of the noise (the server saw each share, or with
        :attr:`secure_sum` their sum alone)."""
        return self.client_level and self.noise_at == "clients"

    @property
    def client_level(self) -> bool:
        """Whether the guarantee protects each client's data as a whole."""
        return self.dp and self.unit == "client"

    @property
    def unit_words(self) -> str:
        """The protected unit in words: "record" or "client"."""
        return "client" if self.client_level else "record"

    @property
    def epsilon(self) -> float:
        """Epsilon after the last round; infinite without DP."""
        if not self.dp or not self.epsilon_per_round:
            return math.inf
        return self.epsilon_per_round[-1]


@dataclass(frozen=True)
class LowFprRate:
    """TPR at FPR <= ``target``: its value and 95% interval, or not estimable when fewer than ``nonmembers_needed``
    non-members were audited (their smallest non-zero FPR is above the target) or when the FPR the test reached is
    above the target beyond its interval (``reason`` says which)."""

    target: float
    tpr: float | None
    ci: tuple[float, float] | None
    estimable: bool
    num_members: int | None
    num_nonmembers: int | None
    nonmembers_needed: int
    fpr: float | None = None
    fpr_ci: tuple[float, float] | None = None
    reason: str | None = None

    @classmethod
    def read(
        cls, entry: RateRecord | None, target: float, num_members: int | None, num_nonmembers: int | None
    ) -> LowFprRate | None:
        """From an attack record's rate: the current form, or a bare number of format-1 results (no interval)."""
        needed = math.ceil(1.0 / target - 1e-9)
        if entry is None:
            return None
        if entry.detailed:
            return cls(
                target,
                entry.tpr,
                entry.ci95,
                entry.estimable,
                num_members if entry.num_members is None else entry.num_members,
                num_nonmembers if entry.num_nonmembers is None else entry.num_nonmembers,
                needed if entry.nonmembers_needed is None else entry.nonmembers_needed,
                entry.fpr,
                entry.fpr_ci95,
                entry.reason,
            )
        if entry.tpr is None:
            return None
        estimable = num_nonmembers is None or num_nonmembers >= needed
        return cls(target, entry.tpr if estimable else None, None, estimable, num_members, num_nonmembers, needed)

    @property
    def off_target(self) -> bool:
        """Measured, but at an FPR whose interval lies above the target (``reason`` says which FPR)."""
        return not self.estimable and self.reason is not None and self.tpr is not None

    def __str__(self) -> str:
        if self.off_target:
            return f"not estimable ({self.reason})"
        if not self.estimable:
            return f"not estimable (n={self.num_nonmembers} non-members per half; needs {self.nonmembers_needed})"
        if self.tpr is None:
            return "not available"
        text = f"{self.tpr:.3f}" + ("" if self.ci is None else f" [{self.ci[0]:.3f}, {self.ci[1]:.3f}]")
        if self.fpr is not None and self.fpr_ci is not None:
            text += f" at FPR {self.fpr:.3f} [{self.fpr_ci[0]:.3f}, {self.fpr_ci[1]:.3f}]"
        return text


@dataclass(frozen=True)
class AttackSummary:
    """One attack result directory (attacks/<signal>-<method>[-round-N]/)."""

    name: str
    signal: str
    method: str
    round: int | None
    auc: float | None
    auc_ci: tuple[float, float] | None
    tpr_at_1pct_fpr: LowFprRate | None
    tpr_at_0_1pct_fpr: LowFprRate | None
    balanced_accuracy: float | None
    advantage: float | None
    epsilon_lower_bound: float | None
    accountant_epsilon: float | None
    num_members: int | None
    num_nonmembers: int | None
    seed: int | None
    auc_se: float | None = None
    advantage_held_out: float | None = None
    advantage_held_out_ci: tuple[float, float] | None = None
    epsilon_lower_bound_test: dict[str, Any] | None = None
    roc: pd.DataFrame | None = field(default=None, compare=False, repr=False)
    canary_audit: dict[str, Any] | None = None  # a canary audit's estimators: an audit of canaries, not of records
    direction: str | None = None  # "inverted": members score lower, with the whole AUC interval below 0.5
    risk: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    references: dict[str, Any] | None = None  # rmia / lira: how many reference models, offline or online
    unit: str = "record"  # what one member is: a record, or a client (attack --method client)

    @property
    def inverted(self) -> bool:
        return self.direction == "inverted"

    def client_rates(self, target: float = 0.01) -> dict[str, LowFprRate]:
        """TPR at FPR <= ``target`` of each client's members (the attack's own threshold), by client id."""
        table = (self.risk or {}).get("tpr_at_fpr_per_client") or {}
        rates = {}
        for client, entry in table.items():
            rate = LowFprRate.read(RateRecord.from_json((entry or {}).get(f"{target:g}")), target, None, None)
            if rate is not None:
                rates[str(client)] = rate
        return rates

    @property
    def label(self) -> str:
        if self.references:
            mode, count = self.references.get("mode", "offline"), self.references.get("count")
            return f"{self.signal}/{self.method} ({mode}, K={count})"
        return f"{self.signal}/{self.method}"

    @property
    def exceeds_accountant(self) -> bool:
        """Whether this attack's own 95% bound is above the accountant's epsilon (a canary audit's verdict)."""
        bound, accountant = self.epsilon_lower_bound, self.accountant_epsilon
        return bound is not None and accountant is not None and bound > accountant

    @property
    def standard_error(self) -> float | None:
        """The AUC's bootstrap standard error; for older results, the width of its 95% interval / (2 x 1.96)."""
        if self.auc_se is not None:
            return self.auc_se
        return None if self.auc_ci is None else (self.auc_ci[1] - self.auc_ci[0]) / (2 * norm.ppf(0.975))

    def epsilon_bound_at(self, confidence: float) -> float | None:
        """This attack's epsilon lower bound recomputed from its recorded test at another confidence (0 when not
        positive); None for results without a recorded test."""
        test = self.epsilon_lower_bound_test
        if test is None:
            return None
        if test["threshold"] is None:  # no test could be chosen: no bound at any confidence
            return 0.0
        bounds = threshold_bounds(
            np.array([test["true_positives"]]),
            np.array([test["false_positives"]]),
            int(test["bound_members"]),
            int(test["bound_nonmembers"]),
            delta=float(test["delta"]),
            confidence=confidence,
        )
        return max(0.0, float(bounds[test["inequality"]][0]))

    def simultaneous_ci(self, compared: int, level: float = 0.95) -> tuple[float, float] | None:
        """The AUC interval that holds for all ``compared`` attacks at once at ``level``: the attack's own
        (bootstrap) interval when it is the only one; for several, the Bonferroni normal interval at level
        1 - (1 - level) / compared, widened where needed to contain the attack's own interval (a normal interval
        can end inside a skewed bootstrap one, and a simultaneous interval is never the narrower)."""
        own = self.auc_ci
        if compared <= 1 and own is not None:
            return own
        se = self.standard_error
        if self.auc is None or se is None:
            return own
        z = norm.ppf(1.0 - (1.0 - level) / (2 * max(compared, 1)))
        low, high = max(0.0, self.auc - z * se), min(1.0, self.auc + z * se)
        return (min(low, own[0]), max(high, own[1])) if own is not None else (low, high)


@dataclass(frozen=True)
class SyntheticSet:
    """What one FedLAP client sent in one round: synthetic images [n, C, H, W] and their labels."""

    round: int
    client: int
    images: np.ndarray = field(repr=False)
    labels: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class ReconstructionSummary:
    """One reconstruction result (attacks/reconstruction-round-N-client-K/): what the attack rebuilt from one client's
    transmission, record by record, and the same for its null."""

    name: str
    round: int
    client: int
    view: str  # update-inversion (a model update) or synthetic-nearest (a synthetic set)
    null_kind: str  # random-update or held-out
    threshold: float  # dB at which a record counts as recovered
    accountant_epsilon: float | None
    psnr: np.ndarray = field(repr=False)  # of each reconstructed record
    ssim: np.ndarray = field(repr=False)
    null_psnr: np.ndarray = field(repr=False)
    null_ssim: np.ndarray = field(repr=False)
    labels_right: int | None = None  # recovered labels that are right (as a multiset), of len(psnr)
    images: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @property
    def quality(self) -> dict[str, Any]:
        """PSNR, SSIM and the recovered fraction, each with its interval and n."""
        return quality_summary(self.psnr, self.ssim, self.threshold)

    @property
    def null_quality(self) -> dict[str, Any]:
        return quality_summary(self.null_psnr, self.null_ssim, self.threshold)


@dataclass(frozen=True)
class ReconstructionRound:
    """The reconstructions of one round of a run, every attacked client's records pooled: the unit a policy and the
    report judge (a record is a record, whichever client held it)."""

    round: int
    view: str
    null_kind: str
    clients: tuple[int, ...]
    threshold: float
    accountant_epsilon: float | None
    quality: dict[str, Any]
    null_quality: dict[str, Any]
    labels_right: int | None
    labels_n: int

    @property
    def no_better_than_null(self) -> bool | None:
        """Whether the mean PSNR's interval reaches down to the null's mean (None without an interval)."""
        psnr, null = self.quality["psnr"], self.null_quality["psnr"]
        if psnr["ci95"] is None or null["mean"] is None:
            return None
        return psnr["ci95"][0] <= null["mean"]


def pool_reconstructions(results: tuple[ReconstructionSummary, ...]) -> tuple[ReconstructionRound, ...]:
    """One :class:`ReconstructionRound` per attacked round (and view), in round order."""
    rounds: dict[tuple[int, str], list[ReconstructionSummary]] = {}
    for result in results:
        rounds.setdefault((result.round, result.view), []).append(result)
    pooled = []
    for (number, view), parts in sorted(rounds.items()):
        threshold = parts[0].threshold
        labelled = [p for p in parts if p.labels_right is not None]
        pooled.append(
            ReconstructionRound(
                round=number,
                view=view,
                null_kind=parts[0].null_kind,
                clients=tuple(sorted(p.client for p in parts)),
                threshold=threshold,
                accountant_epsilon=parts[0].accountant_epsilon,
                quality=quality_summary(
                    np.concatenate([p.psnr for p in parts]), np.concatenate([p.ssim for p in parts]), threshold
                ),
                null_quality=quality_summary(
                    np.concatenate([p.null_psnr for p in parts]),
                    np.concatenate([p.null_ssim for p in parts]),
                    threshold,
                ),
                labels_right=sum(p.labels_right for p in labelled) if labelled else None,
                labels_n=sum(len(p.psnr) for p in labelled),
            )
        )
    return tuple(pooled)


@dataclass(frozen=True)
class RunSummary:
    """Everything a report shows about one run."""

    name: str
    path: Path
    setup: dict[str, Any]
    utility: pd.DataFrame
    privacy: PrivacySummary
    attacks: tuple[AttackSummary, ...]
    synthetic: tuple[SyntheticSet, ...]
    notes: tuple[Note, ...]
    seedless_config: str = ""  # config.json without what differs between seeds of one setting (see group_key)
    test_records: int | None = None  # size of the test split the accuracy is measured on
    verification: Verification | None = None  # the conformance checks of `fedaudit verify`, if it ran
    integrity: tuple[str, ...] = ()  # how the run's files or ledger differ from what fedaudit wrote (none: intact)
    records: int | None = None  # training records held by the clients (n of "delta against 1/n")
    reconstructions: tuple[ReconstructionSummary, ...] = ()  # attack --method reconstruction, by round and client
    randomness: str = RUN_SEED  # where the clients' noise came from (the manifest's source; old runs: the run seed)
    secrets_here: bool = False  # whether the simulated clients' secrets file is in the run directory
    algorithm: str = ""  # the registry's name of the run's algorithm (its facts: :attr:`facts`)

    @property
    def facts(self) -> AlgorithmEntry | None:
        """The run's algorithm's registry entry (what crosses the wire, its rounds, its worst case), if known."""
        return ALGORITHMS.get(self.algorithm)

    @property
    def sends_synthetic(self) -> bool:
        """Whether its clients send synthetic sets rather than model updates."""
        return self.facts is not None and self.facts.wire == WIRE_SYNTHETIC

    @property
    def generates(self) -> bool:
        """Whether its clients first send generated records (a generation round)."""
        return self.facts is not None and self.facts.generation_rounds > 0

    @property
    def worst_case_queries(self) -> str:
        """How its worst-case number of DP queries per round is made up, in words ("" when plain)."""
        return "" if self.facts is None else self.facts.queries_note

    @property
    def reconstruction_rounds(self) -> tuple[ReconstructionRound, ...]:
        """The reconstruction results pooled per attacked round."""
        return pool_reconstructions(self.reconstructions)

    @property
    def rounds_done(self) -> int:
        return int(self.setup["rounds done"])

    @property
    def final_accuracy(self) -> float | None:
        """The test accuracy after the last round done; None where that round was not measured (an interrupted run
        trained with --eval-every), rather than an earlier round's."""
        column = self.utility.get("test_accuracy")
        if column is None or column.empty or pd.isna(column.iloc[-1]):
            return None
        return float(column.iloc[-1])

    @property
    def final_accuracy_ci(self) -> tuple[float, float] | None:
        """Two-sided 95% Clopper-Pearson interval of the final test accuracy over the test split's records."""
        accuracy, n = self.final_accuracy, self.test_records
        if accuracy is None or not n:
            return None
        low, high = rate_interval(round(accuracy * n), n)
        return low, high

    @property
    def group_label(self) -> str:
        """What the run's group is called in tables and figures: algorithm and privacy budget."""
        return f"{self.setup['algorithm']}, {self.setup['privacy budget']}"

    @property
    def final_attacks(self) -> tuple[AttackSummary, ...]:
        """Membership attacks on the final model (round absent or equal to the last round); canary audits apart."""
        return tuple(
            a for a in self.attacks if (a.round is None or a.round == self.rounds_done) and a.canary_audit is None
        )

    @property
    def canary_audits(self) -> tuple[AttackSummary, ...]:
        """The run's canary audits (their bounds are judged against the accountant's epsilon directly)."""
        return tuple(a for a in self.attacks if a.canary_audit is not None)

    @property
    def strongest_canary_audit(self) -> AttackSummary | None:
        """The canary audit view with the highest 95% lower bound (the views' bounds hold simultaneously, so the
        largest still holds at 95%), ties broken by the lower end of the AUC interval."""
        audits = [a for a in self.canary_audits if a.epsilon_lower_bound is not None]
        if not audits:
            return None
        return max(audits, key=lambda a: (a.epsilon_lower_bound, (a.auc_ci or (0.0, 0.0))[0]))

    @property
    def strongest_attack(self) -> AttackSummary | None:
        """The headline attack on the final model: the one whose simultaneous 95% AUC interval (over every final
        attack, :meth:`AttackSummary.simultaneous_ci`) has the highest lower end.

        Picking the largest of several AUC point estimates favours whichever attack the
        noise favoured; intervals that hold for all attacks at once keep the pick honest.
        """
        scored = [a for a in self.final_attacks if a.auc is not None]
        if not scored:
            return None
        compared = len(scored)
        return max(scored, key=lambda a: ((a.simultaneous_ci(compared) or (a.auc, a.auc))[0], a.auc))

    def corrected_bounds(
        self, attacks: tuple[AttackSummary, ...] | None = None, confidence: float = 0.95
    ) -> dict[str, float]:
        """The epsilon lower bound of each of ``attacks`` (default: the final-model attacks) with a recorded test, by
        attack name, recomputed at confidence 1 - (1 - ``confidence``) / K for those K attacks (Bonferroni), so that
        the largest of them still holds at ``confidence``."""
        chosen = self.final_attacks if attacks is None else attacks
        # a client-level attack's bound is judged against an epsilon per client only (a client is many records)
        tested = [
            a
            for a in chosen
            if a.epsilon_lower_bound_test and (a.unit == "record" or self.privacy.client_level or not self.privacy.dp)
        ]
        level = 1.0 - (1.0 - confidence) / max(len(tested), 1)
        return {a.name: a.epsilon_bound_at(level) for a in tested}

    def epsilon_lower_bound(
        self, attacks: tuple[AttackSummary, ...] | None = None, confidence: float = 0.95
    ) -> tuple[float | None, int]:
        """The largest of :meth:`corrected_bounds` and how many attacks it is over; (None, 0) when no attack recorded
        its test."""
        bounds = self.corrected_bounds(attacks, confidence)
        return (max(bounds.values()) if bounds else None), len(bounds)

    @property
    def attacks_compared(self) -> int:
        """How many final-model attacks the strongest was chosen from."""
        return sum(1 for a in self.final_attacks if a.auc is not None)


def collect_runs(paths: list[str | Path]) -> list[RunSummary]:
    """Read every run; a path that is not a fedaudit run is a :class:`ReportError`."""
    if not paths:
        raise ReportError("Give at least one run directory.")
    seen: set[Path] = set()
    summaries = []
    for path in map(Path, paths):
        if path.resolve() not in seen:  # a run given twice is one run, not two seeds of a setting
            seen.add(path.resolve())
            summaries.append(collect_run(path))
    names = [s.name for s in summaries]
    if len(set(names)) < len(names):
        summaries = [_renamed(s, f"{s.name} ({i + 1})") for i, s in enumerate(summaries)]
    return summaries


def _renamed(summary: RunSummary, name: str) -> RunSummary:
    return replace(summary, name=name)


def seedless_config(config: dict[str, Any]) -> str:
    """config.json without the seed, where and on which engine it ran (and how many clients at once, where Flower ran
    them: a study keeps runs that differ in these), and a sigma calibrated per seed: runs equal here differ only by
    seed."""
    privacy = dict(config.get("privacy", {}))
    privacy.pop("noise_seed", None)
    if privacy.pop("calibrated", False):
        privacy.pop("noise_multiplier", None)
    data = {k: v for k, v in config.get("data", {}).items() if k != "data_dir"}
    where = ("seed", "device", "engine", "parallel_clients", "flower", "privacy", "data")
    rest = {k: v for k, v in config.items() if k not in where}
    return json.dumps({**rest, "data": data, "privacy": privacy}, sort_keys=True)


def collect_run(path: Path) -> RunSummary:
    """Read one run directory: setup, utility, privacy ledger, attack results and transmitted synthetic sets."""
    run = RunDirectory(path)
    try:
        run.read_manifest()
        with run.lock("fedaudit report", shared=True):
            return _collect_run(run, path)
    except (RunError, AccountingError) as exc:
        raise ReportError(f"{path}: {exc}" if isinstance(exc, AccountingError) else str(exc)) from exc


MAX_UTILITY_ROWS = 200  # rounds a report's table and accuracy curve show


def _collect_run(run: RunDirectory, path: Path) -> RunSummary:
    """The integrity check comes first: a file it does not trust is never parsed, except the run's own records
    (manifest, config, metrics, ledger) that every section needs, whose failure to parse is then the integrity
    FAIL (:class:`TamperedRunError`), not a crash and not a bad-input error."""
    findings = run.seal.findings()
    integrity = tuple(sentence for _, sentence in findings)
    untrusted = frozenset(name for name, _ in findings)
    try:
        manifest = run.read_manifest()
        config = run.read_run_config()
        metrics = run.read_metrics()
        stored_ledger = run.read_privacy()
        ledger = None if stored_ledger is None else PrivacyLedger.from_dict(stored_ledger)
    except (RunError, AccountingError) as exc:
        if integrity:
            raise TamperedRunError(path, integrity, exc) from exc
        raise ReportError(f"{path}: {exc}" if isinstance(exc, AccountingError) else str(exc)) from exc
    notes: list[Note] = []
    try:
        attacks = _attacks(path, notes, untrusted)
        reconstructions = _reconstructions(run, notes, untrusted)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        if integrity:
            raise TamperedRunError(path, integrity, exc) from exc
        raise ReportError(f"{path} holds malformed attack files ({type(exc).__name__}: {exc}).") from exc
    privacy = _privacy(config, manifest, ledger, path, notes)
    entry = ALGORITHMS.get(config.federated.algorithm)
    shares_synthetic = entry is not None and entry.shares_synthetic
    synthetic = _synthetic(run, untrusted) if shares_synthetic else ()
    if shares_synthetic and not synthetic:
        notes.append(
            Note(
                "No synthetic sets were stored, so none are shown.",
                "train with `--save-transmitted` to keep what every client sent",
            )
        )
    if "test_accuracy" not in metrics.columns or metrics.empty:
        notes.append(
            Note("metrics.csv has no test accuracy.", f"resume or re-train the run: `fedaudit train --resume {path}`")
        )
    utility = metrics[[c for c in ("round", "test_accuracy", "test_loss", "epsilon") if c in metrics.columns]]
    if len(utility) > MAX_UTILITY_ROWS:  # a table and a curve of ~200 rounds say what 100,000 would, in kilobytes
        kept = np.unique(np.linspace(0, len(utility) - 1, MAX_UTILITY_ROWS).round().astype(int))
        notes.append(
            Note(
                f"{len(kept)} of the run's {len(utility)} rounds are shown, evenly spaced.",
                f"read every round in {path / 'metrics.csv'}",
            )
        )
        utility = utility.iloc[kept]
    return RunSummary(
        path.resolve().name,
        path,
        _setup(config, manifest),
        utility,
        privacy,
        attacks,
        synthetic,
        tuple(notes),
        seedless_config(config.to_dict()),
        min(manifest.dataset.test_size, config.evaluation.eval_sample or manifest.dataset.test_size),
        None if run.verification_path.name in untrusted else _verification(run, manifest.rounds_done),
        integrity,
        sum(manifest.clients.num_examples),
        reconstructions,
        manifest.randomness_source,
        run.secrets_path.exists(),
        config.federated.algorithm,
    )


@dataclass(frozen=True)
class ConformanceCheck:
    """One check of `fedaudit verify` as verification.json records it."""

    name: str
    passed: bool
    p_value: float | None
    sentence: str
    checked: bool = True  # False: the check could not be made (a run whose sites keep their records)


@dataclass(frozen=True)
class Verification:
    """What `fedaudit verify` found about a run: its checks, and the round it verified."""

    checks: tuple[ConformanceCheck, ...]
    rounds: int
    current: bool  # whether it verified the run as it stands (the same number of rounds)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> tuple[ConformanceCheck, ...]:
        return tuple(c for c in self.checks if not c.passed)


def _verification(run: RunDirectory, rounds_done: int) -> Verification | None:
    """verification.json, if `fedaudit verify` wrote one; a malformed one is a :class:`ReportError`."""
    if not run.verification_path.is_file():
        return None
    try:
        data = run.read_json(run.verification_path)
        checks = tuple(
            ConformanceCheck(
                str(c["name"]),
                c["passed"] is True,
                None if c.get("p_value") is None else float(c["p_value"]),
                str(c["sentence"]),
                not (isinstance(c.get("details"), dict) and c["details"].get("not_checked") is True),
            )
            for c in data["checks"]
        )
        rounds = int(data["rounds"])
    except (TypeError, KeyError, ValueError) as exc:
        raise ReportError(f"{run.verification_path} is malformed ({type(exc).__name__}: {exc}).") from exc
    return Verification(checks, rounds, rounds == rounds_done)


def _setup(config: RunConfig, manifest: Manifest) -> dict[str, Any]:
    data, federated, model = config.data, config.federated, config.model
    dataset = manifest.dataset
    return {
        "algorithm": algorithm_label(federated.algorithm, config.privacy.dp, config.privacy.dp_level),
        "privacy budget": _label_dp(config) or budget_label(config.privacy),
        "dataset": data.dataset,
        "partition": data.partition,
        "clients": data.num_clients,
        "client fraction": federated.client_fraction,
        "rounds": federated.rounds,
        "rounds done": manifest.rounds_done,
        "status": manifest.status,
        "model": f"{model.arch} ({manifest.model.num_parameters} parameters, built by the user's factory)"
        if ":" in model.arch
        else f"{model.arch} (width {model.width}, depth {model.depth}, {manifest.model.num_parameters} parameters)",
        "batch size": federated.batch_size,
        "local epochs": federated.local_epochs
        if federated.local_steps is None
        else f"none: {federated.local_steps} local steps a round instead (--local-steps; a study's equal data access)",
        "seed": config.seed,
        "engine": manifest.engine,
        "versions": ", ".join(f"{k} {v}" for k, v in manifest.versions.items()),
        "dataset fingerprint": dataset.fingerprint,
        "dataset source": dataset.source,
        "train / test / held-out records": f"{dataset.train_size} / {dataset.test_size} / {manifest.clients.holdout}",
        "DP noise drawn from": noise_origin(config, manifest.randomness_source),
    }


def noise_origin(config: RunConfig, source: str) -> str:
    """Where the clients' DP noise and samples came from, and so who can remove the noise."""
    if not config.dp_randomness:
        return "no DP noise"
    secure = "; secure sampling (ChaCha20, each Gaussian the sum of four)" if config.privacy.secure_noise else ""
    if config.privacy.noise_in_shares and source == CLIENT_SECRETS:
        return (
            "each sampled client's own secret, for its share of the noise; the server samples the clients from its "
            f"own secret (server-secret.json){secure}"
        )
    if config.privacy.client_level and source == CLIENT_SECRETS:
        return (
            f"the server's own secret (server-secret.json): the server adds the noise and samples the clients{secure}"
        )
    if source == CLIENT_SECRETS:
        return (
            "each client's own secret, never sent to the server (whoever holds client-secrets.json, where the clients "
            f"ran, can remove the noise){secure}"
        )
    if source == NOISE_SEED:
        return f"the public --noise-seed {config.privacy.noise_seed}: whoever holds it can remove the noise{secure}"
    return "the run seed (trained before fedaudit kept client secrets): whoever holds config.json can remove the noise"


def _has_record_dp(algorithm: str) -> bool:
    """False for the algorithms that have no record-level DP variant (FedGM, FedDM)."""
    entry = ALGORITHMS.get(algorithm)
    return entry is None or entry.record_dp


def _label_dp(config: RunConfig) -> str | None:
    """FedGM's label-DP statement ("label DP, epsilon E (mechanism)"), or None for a run without one."""
    gm, entry = config.fedgm, ALGORITHMS.get(config.federated.algorithm)
    if entry is None or not entry.label_dp or gm.label_epsilon is None:
        return None
    return f"label DP, epsilon {gm.label_epsilon:g} ({gm.label_mechanism})"


PER_CLIENT = " per client"  # how a client-level run's budget label ends (budget_label)


def budget_label(privacy: PrivacyConfig) -> str:
    """How a run's privacy level was chosen: "epsilon E" (sigma calibrated to it), "sigma S", or "no DP"; at client
    level with " per client" after it."""
    if not privacy.dp:
        return "no DP"
    unit = PER_CLIENT if privacy.client_level else ""
    if privacy.target_epsilon is not None:
        return f"epsilon {privacy.target_epsilon:g}{unit}"
    sigma = privacy.noise_multiplier
    return f"sigma {sigma:g}{unit}" if isinstance(sigma, (int, float)) else f"DP{unit}"


def _privacy(
    config: RunConfig, manifest: Manifest, ledger: PrivacyLedger | None, path: Path, notes: list[Note]
) -> PrivacySummary:
    settings = config.privacy
    label_dp = _label_dp(config)
    if label_dp:
        notes.append(
            Note(
                f"No record-level DP guarantee: epsilon is infinite. The labels this run sent are {label_dp} (against "
                "the substitution of one synthetic image's label); the synthetic images were made from the real "
                "records, class by class, and sent in clear, so they are not protected, nor are the records' labels "
                "(a client's number of images is its number of classes times --distill-ipc). Label DP and "
                "record-level DP are not comparable: the two epsilons bound different neighbours, so this run stands "
                "beside a study's record-level budgets, not on their axis.",
                "read the membership attacks as the measure of what the images leak",
            )
        )
        return PrivacySummary(dp=False)
    entry = ALGORITHMS.get(config.federated.algorithm)
    own = entry.settings_module() if entry is not None else None
    generates = entry is not None and entry.generation_rounds > 0  # its queries sample other populations then
    if settings.dp and hasattr(own, "dp_note"):  # what the algorithm's epsilon covers, in its own words
        notes.append(Note(*own.dp_note(getattr(config, own.SECTION))))
    if not settings.dp:
        notes.append(
            Note(
                "No DP guarantee: epsilon is infinite (the run was trained without differential privacy)."
                + (f" {entry.label}'s generated records were made and sent without DP as well." if generates else "")
                + (
                    f" {algorithm_label(config.federated.algorithm, False)} has no record-level DP variant: a study "
                    "trains it once per seed without DP, beside its budgets, and it is not comparable with them."
                    if not _has_record_dp(config.federated.algorithm)
                    else ""
                ),
                "train with `--dp` (and `--noise-multiplier` or `--target-epsilon`) for a guarantee",
            )
        )
        return PrivacySummary(dp=False)
    if ledger is None:
        notes.append(
            Note(
                "The privacy ledger privacy.json is missing, so no epsilon can be reported.",
                f"if the run stopped before it wrote one, resume it (`fedaudit train --resume {path}`); if its "
                "manifest.json records privacy.json, the file was removed after the run: restore it from a copy of "
                "the run (manifest.json holds its SHA-256)",
            )
        )
        return PrivacySummary(dp=True, accountant=settings.accountant, delta=settings.delta)
    clients = manifest.clients
    sizes, queries = clients.num_examples, clients.dp_queries_per_round
    worst = ledger.worst_client
    if worst is None or not 0 <= worst < len(sizes):
        worst = int(np.argmin(sizes)) if sizes else None
    batch = config.federated.batch_size
    fraction = clients.client_fraction_effective
    q = batch / sizes[worst] if worst is not None and batch and not generates else None
    if ledger.unit == "client":
        secure = secure_aggregation(config) and manifest.randomness_source != NOISE_SEED  # a public seed's noise is
        # anyone's to remove, summed or not
        return _client_level_privacy(ledger, fraction, len(sizes), config.privacy.noise_at, secure)
    return PrivacySummary(
        dp=True,
        accountant=ledger.accountant,
        delta=ledger.delta,
        noise_multiplier=ledger.noise_multiplier,
        max_grad_norm=ledger.max_grad_norm,
        sample_rate=q,
        queries_per_round=queries[worst] if worst is not None and worst < len(queries) and not generates else None,
        client_fraction=fraction,
        batch_size=batch,
        worst_client=worst,
        worst_client_examples=sizes[worst] if worst is not None else None,
        worst_client_rounds=ledger.rounds_charged(worst) if worst is not None else None,
        rounds=ledger.rounds,
        epsilon_per_round=tuple(float(e) for e in ledger.epsilon_per_round),
    )


def _client_level_privacy(
    ledger: PrivacyLedger, fraction: float, clients: int, noise_at: str, secure_sum: bool
) -> PrivacySummary:
    """A client-level run's guarantee: one query per round at the server's client sampling rate, every client
    charged every round."""
    worst = ledger.worst_client
    return PrivacySummary(
        dp=True,
        accountant=ledger.accountant,
        delta=ledger.delta,
        noise_multiplier=ledger.noise_multiplier,
        sample_rate=fraction,
        queries_per_round=1,
        client_fraction=fraction,
        worst_client=worst,
        worst_client_rounds=ledger.rounds_charged(worst) if worst is not None else None,
        rounds=ledger.rounds,
        epsilon_per_round=tuple(float(e) for e in ledger.epsilon_per_round),
        unit="client",
        max_update_norm=ledger.max_update_norm,
        clients=clients,
        noise_at=noise_at,
        secure_sum=secure_sum,
    )


def _changed(name: str, untrusted: frozenset[str]) -> bool:
    """Whether any file of the attack result ``name`` is one the integrity check does not trust."""
    return any(file.startswith(f"attacks/{name}/") for file in untrusted)


def _attacks(path: Path, notes: list[Note], untrusted: frozenset[str] = frozenset()) -> tuple[AttackSummary, ...]:
    run = RunDirectory(path)
    results = []
    for name in run.attacks.names():
        if _changed(name, untrusted):
            notes.append(Note(CHANGED_NOTE.format(name=name), ATTACK_HINT.format(path=path)))
            continue
        try:
            record = run.attacks.read(name)
        except RunError:
            notes.append(
                Note(f"The attack result {name} is unreadable and is left out.", ATTACK_HINT.format(path=path))
            )
            continue
        if record is not None and record.method != RECONSTRUCTION:
            results.append(_attack(run, record, notes))
    if not results:
        notes.append(
            Note(
                "No membership inference results were found, so no empirical leakage is reported.",
                ATTACK_HINT.format(path=path),
            )
        )
    return tuple(sorted(results, key=lambda a: (a.signal, a.method, a.round or 0)))


BOUND_RATES_VERSION = 3  # the attack results' format from which each epsilon bound's rates are at 97.5%


def _attack(run: RunDirectory, record: AttackRecord, notes: list[Note]) -> AttackSummary:
    test = record.epsilon_lower_bound_test
    canary = record.canary_audit is not None
    if record.epsilon_lower_bound is not None and test is None and not canary:
        notes.append(
            Note(
                f"The epsilon lower bound of {record.name} comes from an older fedaudit that took the best "
                "of every threshold of the same records, which is not a valid bound; it is left out.",
                f"re-run `fedaudit attack {run.path}`",
            )
        )
    roc = None
    try:
        bounded_size(run.attacks_dir / record.name / "roc.csv")
        roc = pd.read_csv(run.attacks_dir / record.name / "roc.csv")
        if not {"fpr", "tpr"} <= set(roc.columns):
            roc = None
    except (RunError, OSError, ValueError, pd.errors.ParserError):
        roc = None
    if roc is None:
        notes.append(
            Note(
                f"The ROC curve of {record.name} (roc.csv) is missing or unreadable.",
                f"re-run `fedaudit attack {run.path}`",
            )
        )
    members, nonmembers = record.num_members, record.num_nonmembers
    summary = AttackSummary(
        name=record.name,
        signal=record.signal,
        method=record.method,
        round=record.round,
        auc=record.auc,
        auc_ci=record.auc_ci95,
        tpr_at_1pct_fpr=LowFprRate.read(record.tpr_at_fpr["0.01"], 0.01, members, nonmembers),
        tpr_at_0_1pct_fpr=LowFprRate.read(record.tpr_at_fpr["0.001"], 0.001, members, nonmembers),
        balanced_accuracy=record.balanced_accuracy,
        advantage=record.advantage,
        epsilon_lower_bound=record.epsilon_lower_bound if test is not None or canary else None,
        accountant_epsilon=record.accountant_epsilon,
        num_members=members,
        num_nonmembers=nonmembers,
        seed=record.seed,
        auc_se=record.auc_se,
        advantage_held_out=record.advantage_held_out,
        advantage_held_out_ci=record.advantage_held_out_ci95,
        epsilon_lower_bound_test=None if test is None else dict(test),
        roc=roc,
        canary_audit=None if record.canary_audit is None else dict(record.canary_audit),
        direction=record.direction,
        risk=None if record.risk is None else dict(record.risk),
        references=None if record.references is None else dict(record.references),
        unit=record.unit,
    )
    if test is not None and not canary and (record.format_version or 0) < BOUND_RATES_VERSION:
        # written when each rate was at 95%, which held the bound at 90% only: recomputed from its test
        summary = replace(summary, epsilon_lower_bound=summary.epsilon_bound_at(float(test["confidence"])))
    return summary


RECONSTRUCTION = RECONSTRUCTION_METHOD  # the method of attack --method reconstruction's results


def _reconstructions(
    run: RunDirectory, notes: list[Note], untrusted: frozenset[str] = frozenset()
) -> tuple[ReconstructionSummary, ...]:
    """Every reconstruction result of the run (records.csv for the per-record numbers, images.safetensors for the
    grid); a result whose files cannot be read, or were changed, is left out with a note."""
    found = []
    for name in run.attacks.names():
        if not name.startswith(f"{RECONSTRUCTION}-") or _changed(name, untrusted):
            continue  # a changed one is noted by _attacks
        folder = run.attacks_dir / name
        try:
            metrics = run.read_json(folder / "metrics.json")
            bounded_size(folder / "records.csv")
            records = pd.read_csv(folder / "records.csv")
        except (RunError, OSError, ValueError, pd.errors.ParserError):
            metrics = None
        if not isinstance(metrics, dict) or metrics.get("method") != RECONSTRUCTION:
            notes.append(
                Note(
                    f"The reconstruction result {name} is unreadable and is left out.",
                    f"re-run `fedaudit attack {run.path} --method reconstruction`",
                )
            )
            continue
        view, null = str(metrics["signal"]), str(metrics["null"]["kind"])
        attack, baseline = records[records["kind"] == view], records[records["kind"] == null]
        labels = metrics.get("label_accuracy")
        found.append(
            ReconstructionSummary(
                name=name,
                round=int(metrics["round"]),
                client=int(metrics["client"]),
                view=view,
                null_kind=null,
                threshold=float(metrics["recovered"]["threshold_db"]),
                accountant_epsilon=_finite_number(metrics.get("accountant_epsilon")),
                psnr=attack["psnr"].to_numpy(float),
                ssim=attack["ssim"].to_numpy(float),
                null_psnr=baseline["psnr"].to_numpy(float),
                null_ssim=baseline["ssim"].to_numpy(float),
                labels_right=int(labels["right"]) if isinstance(labels, dict) else None,
                images=_reconstructed_images(folder),
            )
        )
    return tuple(sorted(found, key=lambda r: (r.round, r.client)))


def _finite_number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _reconstructed_images(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(reconstructed, original, PSNR) of a result's best reconstructions, or None when images.safetensors is
    missing or malformed."""
    try:
        tensors = load_file(str(folder / "images.safetensors"))
    except (SafetensorError, OSError, ValueError):
        return None
    shown = tensors.get("reconstructed"), tensors.get("original"), tensors.get("psnr")
    if any(t is None for t in shown) or shown[0].ndim != 4 or shown[0].shape != shown[1].shape:
        return None
    return shown


def _synthetic(run: RunDirectory, untrusted: frozenset[str] = frozenset()) -> tuple[SyntheticSet, ...]:
    """The synthetic sets clients sent, per client and round; unreadable or changed files are skipped.

    At most :data:`SYNTHETIC_ROUNDS` stored rounds are read, evenly spaced and always
    including the first and the last, so that a long run keeps a readable report.
    """
    rounds = sorted(run.transmitted_dir.glob("round-[0-9][0-9][0-9][0-9]")) if run.transmitted_dir.is_dir() else []
    if len(rounds) > SYNTHETIC_ROUNDS:
        rounds = [rounds[i] for i in np.unique(np.linspace(0, len(rounds) - 1, SYNTHETIC_ROUNDS).round().astype(int))]
    sets = []
    for folder in rounds:
        for file in sorted(folder.glob("client-[0-9][0-9][0-9].safetensors")):
            if file.relative_to(run.path).as_posix() in untrusted:
                continue
            try:
                tensors = load_file(str(file))
            except (SafetensorError, OSError, ValueError):
                continue
            images, labels = tensors.get("images"), tensors.get("labels")
            if images is None or labels is None or images.ndim != 4 or not len(labels):
                continue
            sets.append(SyntheticSet(int(folder.name.split("-")[1]), int(file.stem.split("-")[1]), images, labels))
    return tuple(sets)

"""Orchestration of ``fedaudit attack``: read runs, compute signals, run the methods, write and tabulate results.

Every run given is checked completely (manifest, configuration, membership,
data, the weights of every attacked round) before anything is computed, so a
bad input ends with one sentence and leaves no partial results. Results go to
``RUN_DIR/attacks/<signal>-<method>[-round-N]/`` as scores.csv, roc.csv and
metrics.json (written last), each atomically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

import fedaudit
from fedaudit.attacks import AttackError, Draw
from fedaudit.attacks.canary.audit import VIEWS, canary_audit, read_canaries, run_views
from fedaudit.attacks.canary.flower_log import CLIENT_RESULTS, client_canary_results
from fedaudit.attacks.membership.client_audit import client_membership
from fedaudit.attacks.membership.evaluation import (
    EvaluationSet,
    build_evaluation_set,
)
from fedaudit.attacks.membership.methods import MethodOutput, run_method
from fedaudit.attacks.membership.references import MIN_POPULATION, reference_signals, references
from fedaudit.attacks.membership.signals import (
    OUTPUT_SIGNALS,
    SYNTHETIC_SIGNAL,
    Signals,
    compute_signals,
    nearest_distance,
    oriented,
)
from fedaudit.attacks.membership.site_audit import Sites, SiteScorer, refuse, site_signals
from fedaudit.attacks.membership.site_audit import evaluation_set as sites_evaluation_set
from fedaudit.attacks.metrics import auc_score, bootstrap_groups, risk, summarize
from fedaudit.attacks.options import AttackOptions, parse_target
from fedaudit.attacks.options import parse_reconstruction_target as reconstruction_target
from fedaudit.attacks.reconstruction.attack import (
    ReconstructionPlan,
    plan_targets,
    reconstruct,
    result_files,
)
from fedaudit.attacks.registry import (
    CANARY,
    CANARY_METHOD,
    CLIENT,
    CLIENT_METHOD,
    CLIENT_RESULT,
    MEMBERSHIP,
    RECONSTRUCTION,
    RECONSTRUCTION_METHOD,
    REFERENCE,
    AttackEntry,
    attack,
    family_of,
)
from fedaudit.config import RunConfig
from fedaudit.data import Dataset, Partition, load_dataset
from fedaudit.data.sites import is_sites
from fedaudit.errors import UserError
from fedaudit.preparation import resolve_device, run_data
from fedaudit.privacy.accounting import AccountingError, PrivacyLedger
from fedaudit.rundir import (
    RunDirectory,
    RunError,
    csv_bytes,
    json_bytes,
    load_tensors,
    now_iso,
    remove_stale_temporaries,
)
from fedaudit.seeding import Stream, derive_seed, numpy_rng, repeatable

# A client's AUC gets an interval only with at least this many audited members: with fewer, the percentile
# bootstrap's resamples are mostly repeats of the same few records and do not cover at 95% (a federation of many
# small clients has many such; the audit says so instead of computing an interval that means nothing).
MIN_CLIENT_MEMBERS = 5
RESULT_FORMAT = "fedaudit-attack"
RESULT_FORMAT_VERSION = 3  # 3: epsilon bounds with each rate at 97.5%; per-client TPR among the classes' non-members

Echo = Callable[[str], None]


def target_round(options: AttackOptions) -> int | None:
    """The round number ``--target`` names (round:N, round:N:client:K), if any."""
    if options.of(RECONSTRUCTION) and not options.membership:
        rounds, _ = reconstruction_target(options.target)
        return rounds if isinstance(rounds, int) else None
    rounds = parse_target(options.membership_target)
    return rounds if isinstance(rounds, int) else None


@dataclass(frozen=True)
class Target:
    """One attacked model: the global model after ``round``; ``final`` means model.safetensors."""

    round: int
    final: bool

    @property
    def suffix(self) -> str:
        return "" if self.final else f"-round-{self.round}"

    @property
    def label(self) -> str:
        return "final" if self.final else f"round:{self.round}"


@dataclass(frozen=True, eq=False)
class PreparedRun:
    """A run checked and ready to attack: its data, evaluation set and targets."""

    run: RunDirectory
    config: RunConfig
    dataset: Dataset
    evaluation: EvaluationSet
    targets: tuple[Target, ...]
    seed: int
    accountant_epsilon: tuple[float, ...] | None  # per round, None for a non-DP run
    partition: Partition | None = None
    reconstruction: ReconstructionPlan | None = None  # --method reconstruction: its targets, checked
    sites: Sites | None = None  # a run whose records are its sites' (--dataset sites): each site scores its own
    membership: dict[str, np.ndarray] = field(default_factory=dict)

    def records(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and labels of the evaluation set, in its order."""
        ev, ds = self.evaluation, self.dataset
        from_test = ev.source == "test"
        x = torch.empty((len(ev), *ds.train_x.shape[1:]), dtype=ds.train_x.dtype)
        x[torch.from_numpy(~from_test)] = ds.train_x[torch.from_numpy(ev.index[~from_test])]
        x[torch.from_numpy(from_test)] = ds.test_x[torch.from_numpy(ev.index[from_test])]
        return x, torch.from_numpy(ev.label)


@dataclass(frozen=True)
class AttackResult:
    """One attack on one model: what goes into its result directory."""

    name: str
    scores: pd.DataFrame | None
    roc: pd.DataFrame | None
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # a reconstruction's records.csv and images.safetensors


def prepare_run(path: str | Path, options: AttackOptions) -> PreparedRun:
    """Read and check a run directory, load its data and draw the evaluation set; writes nothing."""
    run = RunDirectory(path)
    manifest = run.read_manifest()
    run.seal.check("attack")
    done = manifest.rounds_done
    config = run.read_run_config()
    if done < 1:
        raise RunError(f"{run.path} has no completed round yet, so there is no model to attack.")
    target = parse_target(options.membership_target) if options.membership else None
    if manifest.status != "complete" and target == "final":
        raise RunError(
            f"{run.path} stopped after round {done} of {manifest.rounds} ({manifest.status}), so it has no final "
            f"model yet; finish it with 'fedaudit train --resume {run.path}', or attack a finished round with "
            f"--target round:{done}."
        )
    membership = run.read_membership()
    partition = Partition.from_arrays(membership)
    sites = None
    if is_sites(config.data.dataset):
        dataset, sites = _sites_data(run, config, membership, options)
    else:
        dataset = load_dataset(
            config.data.dataset,
            config.data.data_dir,
            download=False,
            label_column=config.data.label_column,
            image_size=config.data.image_size,
        )
    run.check_dataset(dataset)
    largest = max(int(idx.max(initial=-1)) for idx in (*partition.clients, partition.holdout))
    if (sites is None or sites.local) and largest >= len(dataset.train_y):
        raise RunError(
            f"{run.membership_path} refers to training record {largest}, beyond the {len(dataset.train_y)} records "
            f"of {config.data.dataset}."
        )
    targets = attack_targets(run, target, done) if target is not None else ()
    for target in targets:
        run.load_model(None if target.final else target.round)  # fail now on missing or mismatched weights
    plan = plan_targets(run, config, manifest, options.target) if options.of(RECONSTRUCTION) else None
    accountant = _accountant_epsilon(run, config, max([done, *(t.round for t in targets)]))
    if options.of(CANARY):
        if not config.privacy.dp:
            raise AttackError(
                f"{run.path} was trained without DP, so --method canary has no accountant's epsilon to "
                "audit; train with --dp --canaries N."
            )
        if config.privacy.client_level and not config.audit.canary_clients:
            raise AttackError(
                f"{run.path} was trained without canary clients, so --method canary has nothing to audit; train "
                "with --canary-clients N."
            )
        if not config.privacy.client_level:
            read_canaries(run)
    planted = _planted_records(run, len(dataset.train_y))
    seed = config.seed if options.seed is None else options.seed
    try:
        evaluation = _evaluation_set(partition, dataset, sites, options, seed, planted)
    except AttackError as exc:
        raise AttackError(f"{run.path}: {exc}") from exc
    return PreparedRun(
        run=run,
        config=config,
        dataset=dataset,
        evaluation=evaluation,
        targets=targets,
        seed=seed,
        accountant_epsilon=accountant,
        partition=partition,
        reconstruction=plan,
        sites=sites,
        membership=membership,
    )


def _evaluation_set(
    partition: Partition,
    dataset: Dataset,
    sites: Sites | None,
    options: AttackOptions,
    seed: int,
    planted: np.ndarray | None,
) -> EvaluationSet:
    """The members and non-members the membership attacks score, drawn from the seed (at the sites, for a run whose
    records stay there), without the planted canary records."""
    if sites is not None:
        return sites_evaluation_set(
            partition,
            sites.site_records,
            nonmembers=options.nonmembers,
            max_records=options.max_records,
            seed=seed,
            exclude=planted,
        )
    return build_evaluation_set(
        partition,
        dataset.train_y.numpy(),
        dataset.test_y.numpy(),
        nonmembers=options.nonmembers,
        max_records=options.max_records,
        exclude=planted,
        seed=seed,
    )


def _sites_data(
    run: RunDirectory, config: RunConfig, membership: dict[str, np.ndarray], options: AttackOptions
) -> tuple[Dataset, Sites]:
    """A run whose records are its sites': read here from the files it was trained on (``--site-data``), or held by
    the sites of a deployment (an empty dataset here: the sites score their own records)."""
    if "site_records" not in membership:
        raise RunError(f"{run.membership_path} does not say how many records each site holds.")
    counts = membership["site_records"]
    if config.data.sites:
        return run_data(config)[0], Sites(counts, local=True)
    if options.sites is None:
        raise AttackError(
            f"{run.path} keeps its records at its sites: give the connection to them (--superlink HOST:PORT with "
            "--root-certificates CA or --insecure), so that each site scores its own records."
        )
    unsupported = options.of(REFERENCE, RECONSTRUCTION)
    if unsupported or SYNTHETIC_SIGNAL in options.signals:
        what = f"--method {unsupported[0]}" if unsupported else f"--signal {SYNTHETIC_SIGNAL}"
        raise refuse(what, run.path)
    spec = run.model_spec()
    nothing = torch.zeros((0, *spec.input_shape), dtype=torch.float32)
    empty = torch.zeros(0, dtype=torch.int64)
    manifest = run.read_manifest()
    shell = Dataset(
        name=config.data.dataset,
        train_x=nothing,
        train_y=empty,
        test_x=nothing,
        test_y=empty,
        num_classes=spec.num_classes,
        source=manifest.dataset.source,
        fingerprint=manifest.dataset.fingerprint,
    )
    return shell, Sites(counts, local=False)


def _planted_records(run: RunDirectory, num_records: int) -> np.ndarray | None:
    """The held-out records a run planted as input canaries (its membership audit must not count them as
    non-members: half were trained on), or None."""
    arrays = run.read_canaries()
    if arrays is None or "record" not in arrays:
        return None
    records = arrays["record"].astype(np.int64)
    if records.size and (records.min() < 0 or records.max() >= num_records):
        raise RunError(f"{run.canaries_path} refers to records outside the {num_records} training records.")
    return records


def attack_targets(run: RunDirectory, target: str | int, done: int) -> tuple[Target, ...]:
    """The models to attack; only rounds the manifest has committed count as saved."""
    saved = [r for r in run.checkpoints.rounds() if r <= done]
    if target == "final":
        return (Target(round=done, final=True),)
    if target == "all":
        if not saved:
            raise RunError(
                f"{run.path} has no saved round checkpoints under checkpoints/, so --target all has nothing to attack."
            )
        return tuple(Target(round=r, final=False) for r in saved)
    if target not in saved:
        listed = ", ".join(map(str, saved)) or "none"
        raise AttackError(f"--target round:{target} asks for a round {run.path} did not save (saved rounds: {listed}).")
    return (Target(round=int(target), final=False),)


def _accountant_epsilon(run: RunDirectory, config: RunConfig, last_round: int) -> tuple[float, ...] | None:
    """The accountant's epsilon after each round from privacy.json, or None for a run without DP."""
    if not config.privacy.dp:
        return None
    stored = run.read_privacy()
    if stored is None:
        raise RunError(f"{run.path} is a DP run but privacy.json is missing, so its epsilon cannot be compared.")
    try:
        per_round = PrivacyLedger.from_dict(stored).epsilon_per_round
    except AccountingError as exc:
        raise RunError(f"{run.privacy_path} is not a valid privacy ledger: {exc}") from exc
    if len(per_round) < last_round:
        raise RunError(f"{run.privacy_path} does not record epsilon for round {last_round}; the run is incomplete.")
    return tuple(float(e) for e in per_round)


def attack_run(prepared: PreparedRun, options: AttackOptions) -> list[AttackResult]:
    """Every requested (signal, method) against every target of one run, and the canary audit if asked for."""
    device = resolve_device(options.device)
    repeatable(device)
    results = []
    methods = options.of(MEMBERSHIP, REFERENCE)
    with ExitStack() as stack:
        scorer = None
        if methods and prepared.sites is not None and not prepared.sites.local:
            assert options.sites is not None
            manifest = prepared.run.read_manifest()
            scorer = stack.enter_context(
                options.sites(prepared.config, prepared.membership, manifest.dataset.fingerprint)
            )
        results += _membership_attacks(prepared, options, methods, device, scorer)
    if options.of(CANARY):
        results += _canary(prepared)
    if options.of(CLIENT):
        results.append(_client_attack(prepared, options, device))
    if prepared.reconstruction is not None:
        results += _reconstructions(prepared, options)
    return results


def _membership_attacks(
    prepared: PreparedRun,
    options: AttackOptions,
    methods: list[str],
    device: torch.device,
    scorer: SiteScorer | None,
) -> list[AttackResult]:
    """Every (signal, method) of the membership attacks against every target (the sites of a sites run score their
    own records)."""
    results: list[AttackResult] = []
    plain = [m for m in methods if attack(m).family == MEMBERSHIP]
    with_references = [m for m in methods if attack(m).family == REFERENCE]
    x = y = None
    if methods and (prepared.sites is None or prepared.sites.local):
        x, y = prepared.records()
    for target in prepared.targets if methods else ():
        model = prepared.run.load_model(None if target.final else target.round, device)
        wanted = [s for s in options.signals if s != SYNTHETIC_SIGNAL]
        if prepared.sites is not None:
            signals = site_signals(
                prepared.sites,
                prepared.evaluation,
                model,
                wanted,
                dataset=prepared.dataset,
                scorer=scorer,
                per_layer=options.per_layer,
                batch_size=options.batch_size,
                device=device,
                round_number=target.round,
            )
        else:
            signals = compute_signals(
                model,
                x,
                y,
                wanted,
                per_layer=options.per_layer,
                batch_size=options.batch_size,
                device=device,
                progress=options.progress,
                desc=f"{prepared.run.path.name} {target.label}",
            )
        if SYNTHETIC_SIGNAL in options.signals:
            signals.values[SYNTHETIC_SIGNAL] = nearest_distance(x, _synthetic_images(prepared, target.round))
        _check_finite(prepared, target, signals)
        for signal in options.signals:
            for method in plain:
                results.append(_attack(prepared, target, signals, signal, method, options))
        if with_references and target.final:
            results += _reference_attacks(prepared, target, model, (x, y), signals, with_references, options, device)
    return results


def _reconstructions(prepared: PreparedRun, options: AttackOptions) -> list[AttackResult]:
    """The reconstruction audit of every planned (round, client): one result directory each."""
    run, plan = prepared.run, prepared.reconstruction
    manifest = run.read_manifest()
    results = []
    for target in plan.targets:
        accountant = None if prepared.accountant_epsilon is None else prepared.accountant_epsilon[target.round - 1]
        outcome = reconstruct(
            run,
            prepared.config,
            manifest,
            prepared.dataset,
            prepared.partition,
            target,
            plan.kinds[target.round],
            seed=prepared.seed,
            options=options.reconstruction,
            accountant_epsilon=accountant,
        )
        metrics = {
            "format": RESULT_FORMAT,
            "format_version": RESULT_FORMAT_VERSION,
            "run": str(run.path),
            **outcome.metrics,
            "fedaudit_version": fedaudit.__version__,
            "created": now_iso(),
        }
        results.append(
            AttackResult(name=outcome.name, scores=None, roc=None, metrics=metrics, files=result_files(outcome))
        )
    return results


def _synthetic_images(prepared: PreparedRun, rounds: int) -> torch.Tensor:
    """Every synthetic image that crossed the wire in rounds 1..``rounds`` (what the server saw)."""
    run = prepared.run
    found, sent_updates = [], False
    for round_number in range(1, rounds + 1):
        for file in sorted((run.transmitted_dir / f"round-{round_number:04d}").glob("client-*.safetensors")):
            tensors = load_tensors(file)
            if "images" in tensors:
                found.append(tensors["images"].to(torch.float32))
            else:
                sent_updates = True
    if sent_updates and not found:
        raise AttackError(
            f"{run.path} is a {prepared.config.federated.algorithm} run whose clients sent model updates, not "
            f"synthetic images, so --signal {SYNTHETIC_SIGNAL} has nothing to measure."
        )
    if not found or not sum(len(f) for f in found):
        raise AttackError(
            f"{run.path} kept no synthetic images under transmitted/ for --signal {SYNTHETIC_SIGNAL}; train it "
            "with --save-transmitted."
        )
    return torch.cat(found)


def _check_finite(prepared: PreparedRun, target: Target, signals: Signals) -> None:
    """A model whose outputs are NaN or infinite (its training diverged) cannot be attacked: one sentence."""
    for name, values in signals.values.items():
        bad = int((~np.isfinite(values)).sum())
        if bad:
            raise AttackError(
                f"The {target.label} model of {prepared.run.path} gives a non-finite {name} on {bad} of "
                f"{values.size} audited records (its weights are NaN or infinite: training diverged), so it cannot "
                "be attacked."
            )


def _canary(prepared: PreparedRun) -> list[AttackResult]:
    """The canary audit of every round of the run (what crossed the wire, and for input canaries the final model),
    judged against the final epsilon; for a client-level run, the audit of its canary clients."""
    run, done = prepared.run, prepared.run.read_manifest().rounds_done
    if prepared.config.privacy.client_level:
        views = {name: view for view, name in CLIENT_RESULTS.items()}
        return [
            _canary_result(
                prepared, name, views[name], "final" if views[name] == "final-model" else "all rounds", *audit
            )
            for name, *audit in client_canary_results(run.canary_clients_path, seed=prepared.seed)
        ]
    accountant = None if prepared.accountant_epsilon is None else prepared.accountant_epsilon[done - 1]
    audits = canary_audit(
        run,
        algorithm=prepared.config.federated.algorithm,
        dataset=prepared.dataset,
        rounds=done,
        delta=prepared.config.privacy.delta,
        run_seed=prepared.config.seed,
        seed=prepared.seed,
        accountant_epsilon=accountant,
    )
    return [
        _canary_result(prepared, view.name, view.signal, "final" if view.signal == "loss" else "all rounds", *audit)
        for view, *audit in audits
    ]


def _canary_result(
    prepared: PreparedRun,
    name: str,
    signal: str,
    target: str,
    metrics: dict[str, Any],
    scores: pd.DataFrame,
    curve: pd.DataFrame,
) -> AttackResult:
    """One view of a canary audit as an attack result (its metrics.json between the result's header and footer)."""
    header = {
        "format": RESULT_FORMAT,
        "format_version": RESULT_FORMAT_VERSION,
        "run": str(prepared.run.path),
        "signal": signal,
        "method": CANARY_METHOD,
        "target": target,
        "round": prepared.run.read_manifest().rounds_done,
        "seed": prepared.seed,
    }
    footer = {"fedaudit_version": fedaudit.__version__, "created": now_iso()}
    return AttackResult(name=name, scores=scores, roc=curve, metrics={**header, **metrics, **footer})


def _client_attack(prepared: PreparedRun, options: AttackOptions, device: torch.device) -> AttackResult:
    """Client-level membership inference on the final model (attacks/membership/client_audit.py), judged against
    the run's epsilon only when that epsilon is per client."""
    run, config = prepared.run, prepared.config
    if prepared.partition is None or (prepared.sites is not None and not prepared.sites.local):
        raise AttackError(f"--method client needs {run.path}'s records here; its sites keep them.")
    model = run.load_model(None, device)
    x, y = prepared.dataset.train_x, prepared.dataset.train_y

    def loss_of(index: np.ndarray) -> np.ndarray:
        chosen = torch.from_numpy(index)
        found = compute_signals(model, x[chosen], y[chosen], ["loss"], batch_size=options.batch_size, device=device)
        return np.asarray(found.values["loss"], dtype=np.float64)

    partition = prepared.partition
    planted = _planted_records(run, len(y))
    if planted is not None:  # input canaries: held-out records of which half were trained on, with another label
        partition = Partition(partition.clients, partition.holdout[~np.isin(partition.holdout, planted)])
    metrics, scores, curve = client_membership(
        partition,
        y.numpy(),
        loss_of,
        seed=derive_seed(prepared.seed, Stream.ATTACK, Draw.CLIENT_MEMBERSHIP),
        delta=config.privacy.delta,
        resamples=options.resamples,
    )
    done = run.read_manifest().rounds_done
    comparable = prepared.accountant_epsilon is not None and config.privacy.client_level
    header = {
        "format": RESULT_FORMAT,
        "format_version": RESULT_FORMAT_VERSION,
        "run": str(run.path),
        "signal": "loss",
        "method": CLIENT_METHOD,
        "target": "final",
        "round": done,
        "seed": prepared.seed,
        "accountant_epsilon": prepared.accountant_epsilon[done - 1] if comparable else None,
    }
    if prepared.accountant_epsilon is not None and not comparable:
        header["accountant_epsilon_not_comparable"] = "the run's epsilon is per record, this attack's unit a client"
    accountant = header["accountant_epsilon"]
    judged = {  # a client-level run's epsilon per client bounds this attack; a record-level one's does not
        "epsilon_lower_bound_exceeds_accountant": None
        if accountant is None
        else metrics["epsilon_lower_bound"] > accountant
    }
    footer = {"fedaudit_version": fedaudit.__version__, "created": now_iso()}
    return AttackResult(name=CLIENT_RESULT, scores=scores, roc=curve, metrics={**header, **metrics, **judged, **footer})


def _attack(
    prepared: PreparedRun, target: Target, signals: Signals, signal: str, method: str, options: AttackOptions
) -> AttackResult:
    ev, seed = prepared.evaluation, prepared.seed
    values = signals.values[signal]
    output = run_method(
        method,
        values,
        oriented(signal, values),
        ev.member,
        ev.attack_train,
        seed=derive_seed(seed, Stream.ATTACK, Draw.CLASSIFIER),
    )
    return _result(prepared, target, signals, signal, method, output, options)


def _reference_attacks(
    prepared: PreparedRun,
    target: Target,
    model: torch.nn.Module,
    records: tuple[torch.Tensor, torch.Tensor],
    signals: Signals,
    methods: Sequence[str],
    options: AttackOptions,
    device: torch.device,
) -> list[AttackResult]:
    """RMIA and LiRA against the final model, with reference models trained (or read from the cache) first."""
    refs = references(
        prepared.run,
        prepared.config,
        prepared.dataset,
        prepared.evaluation,
        count=options.references,
        online=options.online,
        seed=prepared.seed,
        device=str(device),
        progress=options.progress,
        population=MIN_POPULATION if "rmia" in methods and options.online else 0,
    )
    x, y = records
    compared = reference_signals(
        refs,
        spec=prepared.run.model_spec(),
        target=model,
        dataset=prepared.dataset,
        x=x,
        y=y,
        signals=options.signals,
        seed=prepared.seed,
        batch_size=options.batch_size,
        device=device,
    )
    results = []
    for signal in options.signals:
        for method in methods:
            if not _takes(attack(method), signal):
                continue  # synthetic-distance reads no model, so reference models have nothing to compare
            output = attack(method).load()(compared, signal, signals.values[signal])
            results.append(_result(prepared, target, signals, signal, method, output, options))
    return results


def _result(
    prepared: PreparedRun,
    target: Target,
    signals: Signals,
    signal: str,
    method: str,
    output: MethodOutput,
    options: AttackOptions,
) -> AttackResult:
    """metrics.json, scores.csv and roc.csv of one method's scores on one signal."""
    ev, seed = prepared.evaluation, prepared.seed
    values = signals.values[signal]
    audit = output.audit
    member = ev.member[audit]
    metrics, curve = summarize(
        ev.member,
        output.scores,
        report=audit,
        select=ev.attack_train,
        delta=prepared.config.privacy.delta,
        rng=numpy_rng(seed, Stream.ATTACK, Draw.BOOTSTRAP),
        resamples=options.resamples,
    )
    accountant = None if prepared.accountant_epsilon is None else prepared.accountant_epsilon[target.round - 1]
    fitted = ~audit
    metrics = {
        "format": RESULT_FORMAT,
        "format_version": RESULT_FORMAT_VERSION,
        "run": str(prepared.run.path),
        "signal": signal,
        "method": method,
        "target": target.label,
        "round": target.round,
        "seed": seed,
        "nonmembers": options.nonmembers,
        "max_records": options.max_records,
        "per_layer": options.per_layer,
        "num_members": int(member.sum()),
        "num_nonmembers": int((member == 0).sum()),
        "num_attack_train_members": int((ev.member[fitted] == 1).sum()),
        "num_attack_train_nonmembers": int((ev.member[fitted] == 0).sum()),
        **metrics,
        "accountant_epsilon": accountant,
        "epsilon_lower_bound_exceeds_accountant": None
        if accountant is None
        else metrics["epsilon_lower_bound"] > accountant,
        "risk": risk(
            ev.member,
            output.scores,
            report=audit,
            select=ev.attack_train,
            client=ev.client,
            label=ev.label,
            record=ev.index,
            source=ev.source,
            kind=ev.label if ev.group is None else ev.group,
        ),
        "per_client": _per_client(
            ev,
            audit,
            output.scores,
            rng=numpy_rng(seed, Stream.ATTACK, Draw.CLIENT_BOOTSTRAP),
            resamples=options.resamples,
        ),
        **output.details,
        "fedaudit_version": fedaudit.__version__,
        "created": now_iso(),
    }
    scores = _scores_table(ev, audit, values, output.scores)
    if signal == "grad-norm":
        scores = scores.assign(**signals.per_layer)
    roc_table = pd.DataFrame({"fpr": curve.fpr, "tpr": curve.tpr, "threshold": curve.thresholds})
    return AttackResult(name=f"{signal}-{method}{target.suffix}", scores=scores, roc=roc_table, metrics=metrics)


def _scores_table(ev: EvaluationSet, audit: np.ndarray, values: np.ndarray, scores: np.ndarray) -> pd.DataFrame:
    """scores.csv: every evaluated record, its membership, its part in the attack and the bound, and its scores."""
    return pd.DataFrame(
        {
            "record": ev.index,
            "source": ev.source,
            "label": ev.label,
            "client": ev.client,
            "member": ev.member,
            "split": np.where(audit, "audit", "attack-train"),
            "bound_role": np.where(ev.attack_train, "choose", "judge"),
            "signal": values,
            "score": scores,
        }
    )


def _per_client(
    ev: EvaluationSet, audit: np.ndarray, scores: np.ndarray, *, rng: np.random.Generator, resamples: int
) -> dict[str, dict[str, Any]]:
    """AUC (with its bootstrap 95% interval) of each client's audited members against the audited non-members of that
    client's classes."""
    table: dict[str, dict[str, Any]] = {}
    nonmember = audit & (ev.member == 0)
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, classes in ev.client_classes.items():  # clients of the same classes share their non-members
        groups.setdefault(tuple(sorted(int(c) for c in classes)), []).append(k)
    kind = ev.label if ev.group is None else ev.group
    for classes, clients in groups.items():
        others = nonmember & np.isin(kind, classes)
        members = {k: audit & (ev.client == k) for k in clients}
        scored = [k for k in clients if members[k].sum() >= MIN_CLIENT_MEMBERS and others.any()]
        boots = (  # none without a client to score (then possibly no non-member either: nothing to resample)
            bootstrap_groups(scores[others], [scores[members[k]] for k in scored], rng=rng, resamples=resamples)
            if scored
            else []
        )
        intervals = {k: list(boot.interval(boot.auc)) for k, boot in zip(scored, boots)}
        for k in clients:
            both = members[k] | others
            auc = auc_score(ev.member[both], scores[both]) if k in intervals else None
            table[str(k)] = {
                "auc": auc,
                "auc_ci95": intervals.get(k),
                "num_members": int(members[k].sum()),
                "num_nonmembers": int(others.sum()),
            }
            if k not in intervals:
                table[str(k)]["not_resolved"] = (
                    f"{int(members[k].sum())} audited member(s), fewer than {MIN_CLIENT_MEMBERS}: a bootstrap over so "
                    "few records repeats them and its interval is not a 95% interval, so none is given"
                    if others.any()
                    else "no audited non-member to compare with (of this client's classes, or of its site)"
                )
    return dict(sorted(table.items(), key=lambda item: int(item[0])))


CANARY_NAMES = (*(view.name for view in VIEWS), *CLIENT_RESULTS.values())


def _canary_names(run: RunDirectory) -> list[str]:
    """The results a canary audit of ``run`` writes: one per view of its canaries, or of its canary clients."""
    if run.read_run_config().privacy.client_level:
        return list(CLIENT_RESULTS.values())
    return [view.name for view in run_views(run)]


def _takes(entry: AttackEntry, signal: str) -> bool:
    """Whether ``entry`` attacks with ``signal`` (RMIA compares output probabilities; the reference attacks compare
    models, which the distance to the synthetic records does not read)."""
    return (not entry.output_signals_only or signal in OUTPUT_SIGNALS) and (
        entry.synthetic_signal or signal != SYNTHETIC_SIGNAL
    )


def _writes(entry: AttackEntry, target: Target, signal: str) -> bool:
    """Whether ``entry`` writes a result of its own for ``signal`` against ``target``."""
    return entry.per_signal and (not entry.final_only or target.final) and _takes(entry, signal)


def expected_results(run: RunDirectory, options: AttackOptions) -> dict[str, int]:
    """The result directories ``options`` would write for ``run`` as it stands, each with the round it attacks
    (empty when the run cannot be attacked)."""
    try:
        manifest = run.read_manifest()
        targets = (
            attack_targets(run, parse_target(options.membership_target), manifest.rounds_done)
            if options.membership
            else ()
        )
        planned = (
            plan_targets(run, run.read_run_config(), manifest, options.target).targets
            if options.of(RECONSTRUCTION)
            else ()
        )
    except (RunError, AttackError):
        return {}
    expected = {
        f"{signal}-{method}{target.suffix}": target.round
        for target in targets
        for signal in options.signals
        for method in options.methods
        if _writes(attack(method), target, signal)
    }
    if options.of(CANARY):
        try:
            names = _canary_names(run)
        except (RunError, AttackError):
            return {}
        expected.update({name: run.read_manifest().rounds_done for name in names})
    if options.of(CLIENT):
        expected[CLIENT_RESULT] = run.read_manifest().rounds_done
    expected.update({target.name: target.round for target in planned})
    return expected


def results_current(path: str | Path, options: AttackOptions) -> bool:
    """Whether ``path`` already holds every result ``options`` would write, for its current rounds and settings.

    A result counts when its metrics.json (written last) has the current result format and names the same round, seed,
    non-member source, record cap, bootstrap size and per-layer choice; anything else means recomputing.
    """
    run = RunDirectory(path)
    try:
        config = run.read_run_config()
    except RunError:
        return False
    names = expected_results(run, options)
    seed = config.seed if options.seed is None else options.seed
    expected = {
        "seed": seed,
        "nonmembers": options.nonmembers,
        "max_records": options.max_records,
        "bootstrap_resamples": options.resamples,
        "per_layer": options.per_layer,
    }
    for name, round_number in names.items():
        if name.startswith(f"{RECONSTRUCTION_METHOD}-"):
            if not _reconstruction_current(run, name, round_number, seed, options):
                return False
            continue
        try:
            record = run.attacks.read(name)
        except RunError:
            return False
        if (
            record is None
            or record.format_version != RESULT_FORMAT_VERSION
            or record.round != round_number
            or any(
                record.settings.get(k) != v
                for k, v in (expected if name not in (*CANARY_NAMES, CLIENT_RESULT) else {"seed": seed}).items()
            )
            or (family_of(name.rpartition("-")[2]) == REFERENCE and not _same_references(record.references, options))
        ):
            return False
    return bool(names)


def _reconstruction_current(run: RunDirectory, name: str, round_number: int, seed: int, options: AttackOptions) -> bool:
    """Whether a reconstruction result is of the current format, round, seed and attack settings."""
    try:
        stored = run.read_json(run.attacks_dir / name / "metrics.json")
    except RunError:
        return False
    wanted = options.reconstruction
    settings = stored.get("settings") if isinstance(stored, dict) else None
    return (
        isinstance(settings, dict)
        and stored.get("format_version") == RESULT_FORMAT_VERSION
        and stored.get("round") == round_number
        and stored.get("seed") == seed
        and all(settings.get(key) == getattr(wanted, key) for key in ("iterations", "restarts", "psnr_threshold"))
    )


def _same_references(stored: Mapping[str, Any] | None, options: AttackOptions) -> bool:
    """Whether a LiRA or RMIA result used the references ``options`` asks for (count and mode)."""
    mode = "online" if options.online else "offline"
    return stored is not None and stored.get("count") == options.references and stored.get("mode") == mode


def write_result(run: RunDirectory, result: AttackResult) -> Path:
    """Write one result directory atomically, metrics.json last; returns the directory."""
    directory = run.attacks_dir / result.name
    with run.staged():
        if result.scores is not None:
            run.put(directory / "scores.csv", csv_bytes(result.scores))
        if result.roc is not None:
            run.put(directory / "roc.csv", csv_bytes(result.roc))
        for name, data in result.files.items():
            run.put(directory / name, data)
        run.put(directory / "metrics.json", json_bytes(result.metrics))
    return directory


def run_attacks(paths: Sequence[str | Path], options: AttackOptions, *, echo: Echo = print) -> list[AttackResult]:
    """Check every run, then attack each and write its results (``fedaudit attack``).

    Args:
        paths: run directories written by ``fedaudit train``.
        options: what to attack and how (checked first).
        echo: receives one line per run.

    Returns:
        Every result, run by run, in the order of ``paths``.

    Raises:
        UserError: a bad option or a run that cannot be attacked; raised before anything is computed or written.
    """
    options.validate()
    resolve_device(options.device)
    locks = []
    try:
        for path in dict.fromkeys(Path(p) for p in paths):
            RunDirectory(path).read_manifest()  # a directory that is not a run is told so before it is locked
            locks.append(RunDirectory(path).lock("fedaudit attack"))
            remove_stale_temporaries(Path(path), ("attacks",))  # what an interrupted attack left
        return _attack_runs(paths, options, echo)
    finally:
        for lock in locks:
            lock.release()


def _attack_runs(paths: Sequence[str | Path], options: AttackOptions, echo: Echo) -> list[AttackResult]:
    prepared = [prepare_run(path, options) for path in paths]
    results: list[AttackResult] = []
    for run in prepared:
        run_results = attack_run(run, options)
        for result in run_results:
            write_result(run.run, result)
        echo(f"{len(run_results)} result(s) written to {run.run.attacks_dir}")
        if options.of(CANARY) and any(run.run.queries_dir.glob("round-*.safetensors")):
            _verify_canary_run(run, echo)
        results += run_results
    return results


def _verify_canary_run(prepared: PreparedRun, echo: Echo) -> None:
    """The conformance checks of a canary run, beside its canary audit (what ``fedaudit verify`` writes), so that
    the report sees both; a run whose records cannot be checked says why in one line and keeps its results."""
    from fedaudit.attacks.conformance.checks import verify
    from fedaudit.attacks.conformance.verify import write_verification

    try:
        verification = verify(prepared.run, seed=prepared.seed)
    except UserError as exc:
        echo(f"verify: {prepared.run.path} cannot be checked: {exc}")
        return
    write_verification(prepared.run, verification, prepared.seed)
    failed = [check.name for check in verification.checks if not check.passed]
    verdict = "PASS" if not failed else f"FAIL ({', '.join(failed)}; see fedaudit verify {prepared.run.path})"
    echo(f"verify: {verdict}, written to {prepared.run.verification_path}")


def results_table(results: Sequence[AttackResult]) -> pd.DataFrame:
    """One row per result: the headline numbers of metrics.json ("eps" is the accountant's, "no DP" without DP,
    "per record" for a client-level attack on a record-level run, whose epsilon does not bound it;
    the advantage is the held-out one, with its interval)."""
    rows = []
    for result in results:
        m = result.metrics
        if m.get("method") == RECONSTRUCTION_METHOD:
            continue
        rows.append(
            {
                "run": m["run"],
                "round": m["round"],
                "signal": m["signal"],
                "method": m["method"],
                "members": m["num_members"],
                "non-members": m["num_nonmembers"],
                "AUC": m["auc"],
                "AUC 95% CI": f"[{m['auc_ci95'][0]:.3f}, {m['auc_ci95'][1]:.3f}]" if "auc_ci95" in m else "-",
                "TPR@1%FPR": _rate(m["tpr_at_fpr"]["0.01"]) if "tpr_at_fpr" in m else "-",
                "TPR@0.1%FPR": _rate(m["tpr_at_fpr"]["0.001"]) if "tpr_at_fpr" in m else "-",
                "adv held-out [95%]": _held_out(m.get("advantage_held_out")),
                "eps_lb": m["epsilon_lower_bound"],
                "eps": f"{m['accountant_epsilon']:.3f}"
                if m["accountant_epsilon"] is not None
                else "per record"
                if "accountant_epsilon_not_comparable" in m
                else "no DP",
            }
        )
    return pd.DataFrame(rows)


def _held_out(entry: dict[str, Any] | None) -> str:
    """The advantage of a threshold chosen on the attack-training half, measured on the audit half, with its
    interval: the one advantage fedaudit shows (the best threshold of the same records is optimistic)."""
    if not entry or entry.get("advantage") is None:
        return "-"
    ci = entry.get("ci95")
    return f"{entry['advantage']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _rate(entry: dict[str, Any]) -> str:
    """A TPR at low FPR for the console table, with the FPR its held-out threshold reached, or why the sample cannot
    resolve that FPR."""
    if entry["estimable"]:
        return f"{entry['tpr']:.3f} (FPR {entry['fpr']:.3f})"
    if entry.get("fpr") is not None:
        return f"n/e (FPR reached {entry['fpr']:.3f})"
    return f"n/e (<{entry['nonmembers_needed']} non-members)"

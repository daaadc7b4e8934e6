"""``fedaudit compare``: a whole study (algorithms x privacy budgets x seeds) trained, attacked and reported at once.

This module sits beside the command line, above the three packages: it is the one place that calls training
(:mod:`fedaudit.training`), the attacks (:mod:`fedaudit.attacks`) and the reports (:mod:`fedaudit.reports`) in
turn, so that none of them reaches into another.

A study directory holds ``study.json`` (the study as last run), ``runs/<name>/``
(one run directory per algorithm, budget and seed, each with its ``attacks/``)
and the comparison report. Running a study again does only what is missing:
complete runs whose configuration matches the plan are kept, interrupted ones
are resumed, attacks whose results exist for the run's last round and the same
settings are kept, and the report is rebuilt from the run directories. Adding a
seed, a budget or an algorithm to a study therefore trains only the new runs.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from fedaudit.attacks.options import AttackOptions, ReconstructionOptions
from fedaudit.attacks.registry import CANARY, REFERENCE, family_of
from fedaudit.attacks.registry import RECONSTRUCTION_METHOD as RECONSTRUCTION
from fedaudit.attacks.runner import expected_results, results_current, run_attacks, target_round
from fedaudit.config import MAX_SEED, ConfigError, RunConfig, load_config_file
from fedaudit.preparation import Setup, data_access, prepare
from fedaudit.registry import ALGORITHMS, EQUAL_ACCESS_REFERENCE, algorithm_label, client_dp_algorithms
from fedaudit.reports.collect import collect_runs
from fedaudit.reports.policy import Policy, load_policy, read_yaml
from fedaudit.reports.render import FORMATS, SUFFIXES, ReportOutcome, output_paths, write_report
from fedaudit.rundir import RunDirectory, RunError, atomic_write_json, now_iso, remove_stale_temporaries
from fedaudit.rundir.integrity import RunLock
from fedaudit.study_settings import Budget, StudyError, StudySettings
from fedaudit.training import resume, time_first_round, train_setup

STUDY_FORMAT = "fedaudit-study"
STUDY_FILE = "study.json"
RUNS_DIR = "runs"
CONFIRM_SECONDS = 600  # a study estimated to take longer starts only with --yes (or in CI)
# What a study file's "attack" section may set, and the AttackOptions field each one fills.
ATTACK_KEYS: dict[str, str] = {
    "signals": "signals",
    "methods": "methods",
    "target": "target",
    "nonmembers": "nonmembers",
    "max_records": "max_records",
    "per_layer": "per_layer",
    "batch_size": "batch_size",
    "bootstrap": "resamples",
    "seed": "seed",
    "references": "references",
    "online": "online",
    "reconstruction": "reconstruction",  # iterations, restarts, psnr_threshold of --method reconstruction
}
RECONSTRUCTION_KEYS = ("iterations", "restarts", "psnr_threshold")
STUDY_KEYS = ("algorithms", "budgets", "seeds", "equal_data_access", "max_update_norm", "base", "attack", "report")

Echo = Callable[[str], None]


@dataclass(frozen=True)
class Study(StudySettings):
    """What a study compares and how each run is attacked and reported: the study's own settings, the base
    configuration of its runs and the attack's options."""

    base: RunConfig = field(default_factory=RunConfig)
    attack: AttackOptions = field(default_factory=AttackOptions)

    def to_dict(self) -> dict[str, Any]:
        """The study as written to study.json (and as a study file would give it)."""
        attack = {key: getattr(self.attack, name) for key, name in ATTACK_KEYS.items()}
        attack["reconstruction"] = {key: getattr(self.attack.reconstruction, key) for key in RECONSTRUCTION_KEYS}
        return {
            "algorithms": list(self.algorithms),
            "budgets": [str(b) for b in self.budgets],
            "seeds": list(self.seeds),
            "equal_data_access": self.equal_data_access,
            "max_update_norm": self.max_update_norm,
            "base": self.base.to_dict(),
            "attack": {key: list(value) if isinstance(value, tuple) else value for key, value in attack.items()},
            "report": {"formats": list(self.formats), "policy": self.policy},
        }

    def validate(self) -> None:
        """Raise :class:`StudyError` (or the attack's error) for the first thing that cannot work."""
        if not self.algorithms:
            raise StudyError("A study needs at least one algorithm.")
        for name in self.algorithms:
            if name not in ALGORITHMS:
                raise StudyError(f"Unknown algorithm {name!r} in the study; choose from {', '.join(ALGORITHMS)}.")
        if not self.budgets:
            raise StudyError("A study needs at least one budget (epsilon:E, sigma:S or none).")
        if not self.seeds or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in self.seeds):
            raise StudyError(f"Study seeds must be non-negative integers, got {list(self.seeds)!r}.")
        privacy = self.base.privacy
        if privacy.dp or privacy.noise_multiplier is not None or privacy.target_epsilon is not None:
            raise StudyError(
                "The base configuration must not set privacy.dp, noise_multiplier or target_epsilon: "
                "a study's budgets set them for every run."
            )
        if self.base.seed != RunConfig().seed:
            raise StudyError(
                f"The base configuration sets seed {self.base.seed!r}, but a study's seeds set every run's: give "
                f"seeds: [{self.base.seed!r}] instead."
            )
        if any(budget.client_level for budget in self.budgets):
            _check_client_level(self)
        elif self.max_update_norm is not None and not _positive(self.max_update_norm):
            raise StudyError(f"max_update_norm must be a positive number, got {self.max_update_norm!r}.")
        self.attack.reconstruction.validate()  # given in the study file, checked even where no method reads it
        if self.equal_data_access:
            if EQUAL_ACCESS_REFERENCE not in self.algorithms:
                raise StudyError(
                    "Equal data access gives the gradient-sharing baselines as many DP queries per round as "
                    "FedLAP makes, so the study must include fedlap."
                )
            for name in self.algorithms:
                _check_equal_access(name)
        for name in self.formats:
            if name not in FORMATS:
                raise StudyError(f"Unknown report format {name!r}; choose from {', '.join(FORMATS)}.")
        self.attack.validate()


def _check_client_level(study: Study) -> None:
    """A study with client-level budgets needs their clipping norm and an algorithm that has a client level."""
    norm = study.max_update_norm
    if not _positive(norm):
        raise StudyError(
            f"A client-level budget needs --max-update-norm (max_update_norm in a study file), a positive number, got "
            f"{norm!r}."
        )
    if not any(ALGORITHMS[name].client_dp for name in study.algorithms):
        raise StudyError(
            f"No algorithm of the study has a client level ({', '.join(client_dp_algorithms())} have), so its "
            "client-level budgets would train nothing."
        )


def _positive(value: Any) -> bool:
    """A finite positive number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


@dataclass(frozen=True)
class PlannedRun:
    """One run of a study and the configuration it is trained with."""

    name: str
    algorithm: str
    budget: Budget
    seed: int
    config: RunConfig


def load_study(path: str | Path) -> Study:
    """Read a YAML (or JSON) study file; unknown keys and malformed values are a :class:`StudyError`.

    Example::

        algorithms: [fedavg, fedprox, fedlap]
        budgets: ["epsilon:2", "epsilon:8", none]
        seeds: [0, 1, 2]
        equal_data_access: true
        base:                      # a run configuration, as config.json or train --config
          data: {dataset: fashion-mnist, partition: "classes:2", num_clients: 5}
          model: {width: 32}
          federated: {rounds: 3}
        attack: {signals: [loss, grad-norm], methods: [threshold, classifier], target: final}
        report: {formats: [html, pdf], policy: policy.yaml}
    """
    file = Path(path)
    data = read_yaml(file, "study file", StudyError)
    if not isinstance(data, dict):
        raise StudyError(f"The study file {file} must be a mapping with keys such as algorithms, budgets and seeds.")
    unknown = [key for key in data if key not in STUDY_KEYS]
    if unknown:
        raise StudyError(f"Unknown key {unknown[0]!r} in the study file {file}; use {', '.join(STUDY_KEYS)}.")
    values: dict[str, Any] = {}
    if "algorithms" in data:
        values["algorithms"] = tuple(str(a) for a in _as_list(data["algorithms"], "algorithms", file))
    if "budgets" in data:
        values["budgets"] = tuple(Budget.parse(b) for b in _as_list(data["budgets"], "budgets", file))
    if "seeds" in data:
        values["seeds"] = tuple(_as_list(data["seeds"], "seeds", file))
    if data.get("max_update_norm") is not None:
        values["max_update_norm"] = data["max_update_norm"]
    if "equal_data_access" in data:
        if not isinstance(data["equal_data_access"], bool):
            raise StudyError(f"equal_data_access in the study file {file} must be true or false.")
        values["equal_data_access"] = data["equal_data_access"]
    if data.get("base") is not None:
        try:
            values["base"] = RunConfig.from_dict(data["base"])
        except (ConfigError, TypeError) as exc:
            raise StudyError(f"The base configuration in the study file {file} is invalid: {exc}") from exc
    attack = _section(data, "attack", file)
    unknown = [key for key in attack if key not in ATTACK_KEYS]
    if unknown:
        raise StudyError(f"Unknown key {unknown[0]!r} in the attack section of {file}; use {', '.join(ATTACK_KEYS)}.")
    values["attack"] = replace(
        AttackOptions(),
        **{
            ATTACK_KEYS[key]: tuple(_as_list(value, key, file))
            if key in ("signals", "methods")
            else _reconstruction_options(value, file)
            if key == "reconstruction"
            else value
            for key, value in attack.items()
        },
    )
    report = _section(data, "report", file)
    unknown = [key for key in report if key not in ("formats", "policy")]
    if unknown:
        raise StudyError(f"Unknown key {unknown[0]!r} in the report section of {file}; use formats and policy.")
    if "formats" in report:
        values["formats"] = tuple(str(f).lower() for f in _as_list(report["formats"], "formats", file))
    if report.get("policy") is not None:
        policy = Path(str(report["policy"]))
        values["policy"] = str(policy if policy.is_absolute() else file.parent / policy)
    return Study(**values)


def _reconstruction_options(value: Any, file: Path) -> ReconstructionOptions:
    """The attack section's ``reconstruction`` mapping (iterations, restarts, psnr_threshold)."""
    if not isinstance(value, dict):
        raise StudyError(
            f"reconstruction in the attack section of {file} must be a mapping of {', '.join(RECONSTRUCTION_KEYS)}."
        )
    unknown = [key for key in value if key not in RECONSTRUCTION_KEYS]
    if unknown:
        raise StudyError(
            f"Unknown key {unknown[0]!r} in the attack section's reconstruction of {file}; use "
            f"{', '.join(RECONSTRUCTION_KEYS)}."
        )
    return ReconstructionOptions(**value)


def _as_list(value: Any, key: str, file: Path) -> list[Any]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise StudyError(f"{key} in the study file {file} is empty.")
    return items


def _section(data: Mapping[str, Any], key: str, file: Path) -> dict[str, Any]:
    section = data.get(key) or {}
    if not isinstance(section, dict):
        raise StudyError(f"The {key} section of the study file {file} must be a mapping.")
    return section


def plan(study: Study) -> list[PlannedRun]:
    """Every run of the study, seeds outermost (so the first seed's comparison is complete first)."""
    study.validate()
    runs = []
    for seed in study.seeds:
        for budget in study.budgets:
            for algorithm in study.algorithms:
                # without record-level DP (FedGM, FedDM): trained once per seed, beside the budgets; without a
                # client level (FedLAP, SCAFFOLD, ...): not trained at a client-level budget (skipped_runs says so)
                if budget.client_level and not ALGORITHMS[algorithm].client_dp:
                    continue
                own = budget if ALGORITHMS[algorithm].record_dp else Budget("none")
                name = f"{algorithm}-{own.slug}-seed{seed}"
                earlier = next((run for run in runs if run.name == name), None)
                if earlier is not None:
                    if earlier.budget != own:  # one name for two budgets: the second would be dropped unseen
                        exact = [f"{'client:' * b.client_level}{b.kind}:{b.value!r}" for b in (earlier.budget, own)]
                        raise StudyError(
                            f"The budgets {exact[0]} and {exact[1]} give their runs one name ({name}): give budgets "
                            "that differ within their first six significant digits."
                        )
                    continue  # the same run given twice (sigma:1 and sigma:1.0, none and no-dp, ...)
                base = replace(study.base, seed=seed, federated=replace(study.base.federated, algorithm=algorithm))
                if base.privacy.noise_seed is not None:  # reproducible noise, another stream for every seed
                    noise_seed = (base.privacy.noise_seed + seed) % (MAX_SEED + 1)
                    base = replace(base, privacy=replace(base.privacy, noise_seed=noise_seed))
                if RECONSTRUCTION in study.attack.methods:  # the audit reads what crossed the wire
                    base = replace(base, save_transmitted=True)
                config = own.apply(_own_sections(base, algorithm), max_update_norm=study.max_update_norm)
                runs.append(PlannedRun(name, algorithm, own, seed, config))
    if study.equal_data_access:
        runs = [_equal_data_access(run) for run in runs]
    return runs


OWN_SECTIONS = ("fedgm", "feddm", "fedssyn")  # configuration sections that only their algorithm reads


def _own_sections(config: RunConfig, algorithm: str) -> RunConfig:
    """``config`` with the algorithm-specific sections of the other algorithms at their defaults: a study's base may
    set FedGM's label epsilon or Fedssyn's generator for those runs without refusing every other run."""
    defaults = RunConfig()
    return replace(config, **{name: getattr(defaults, name) for name in OWN_SECTIONS if name != algorithm})


def _check_equal_access(name: str) -> None:
    """An algorithm that takes one step a round (FedSGD) cannot be given more queries."""
    if ALGORITHMS[name].one_step:
        raise StudyError(
            f"{name} makes one query per round and cannot be run at equal data access; drop it or "
            "turn equal data access off."
        )


def _equal_data_access(run: PlannedRun) -> PlannedRun:
    """FedAvg/FedProx/SCAFFOLD run as many local steps (DP queries) per round as FedLAP's worst case under the same
    budget."""
    if not ALGORITHMS[run.algorithm].local_sgd:
        return run
    try:
        queries = data_access(run.config, algorithm=EQUAL_ACCESS_REFERENCE).queries
    except ConfigError as exc:
        raise StudyError(f"FedLAP's query count for equal data access cannot be computed: {exc}") from exc
    return replace(run, config=replace(run.config, federated=replace(run.config.federated, local_steps=queries)))


def run_study(
    study: Study,
    out: str | Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    echo: Echo = tqdm.write,
    yes: bool = False,
) -> ReportOutcome:
    """Train, attack and report every run of ``study`` under ``out``, skipping what is already done (``fedaudit
    compare``).

    Everything that can be checked (the study, every run's configuration and data,
    the attack options, the report formats and policy, runs already in ``out``) is
    checked before anything is written. With ``overwrite``, runs whose stored
    configuration differs from the plan are retrained instead of being an error.

    Args:
        study: algorithms x budgets x seeds, the base configuration, attack and report settings.
        out: the study directory (study.json, runs/<name>/, the comparison report).
        overwrite: retrain runs whose stored configuration differs from the plan.
        progress: show a progress bar over the study.
        echo: receives the plan with its estimated time, then each run's lines, prefixed by the run's name.
        yes: start a study estimated to take longer than :data:`CONFIRM_SECONDS` (outside CI, where it always
            starts, it is otherwise refused before anything is written).

    Returns:
        The comparison report's outcome (files written, policy verdict).

    Raises:
        UserError: a study, configuration, attack or report problem, before anything is written.
    """
    folder = Path(out)
    planned = plan(study)
    if folder.suffix.lower() in SUFFIXES:
        raise StudyError(
            f"--out {folder} names a report file, but a study needs a directory (the report goes inside it)."
        )
    output_paths(folder, study.formats, folder_only=True)
    policy = load_policy(study.policy) if study.policy else None
    setups = [prepare(run.config) for run in planned]
    if study.attack.of(CANARY) and all(attack_for(study.attack, s.config) is not study.attack for s in setups):
        raise StudyError(
            "--method canary audits DP runs trained with canaries, and no run of this study has any: a record-level "
            "budget with the base's audit.canaries N, or a client-level one with audit.canary_clients N."
        )
    target = target_round(study.attack)
    if target is not None and any(target > setup.config.federated.rounds for setup in setups):
        raise StudyError(f"--target round:{target} asks for a round after the last one the study trains.")
    _check_folder(folder)
    actions = [_action(folder / RUNS_DIR / run.name, setup, overwrite) for run, setup in zip(planned, setups)]
    attack = replace(study.attack, device=study.base.device, progress=False)
    expected = estimate_study(planned, setups, actions, folder, attack, echo=echo)
    for line in expected.lines(len(planned), actions.count("keep")):
        echo(line)
    for skipped in skipped_runs(study):
        echo(f"Not trained: {skipped}.")
    if expected.seconds > CONFIRM_SECONDS and not yes and not os.environ.get("CI"):
        raise StudyError(
            f"This study would take about {_duration(expected.seconds)} here, more than "
            f"{CONFIRM_SECONDS // 60} minutes: run it again with --yes to start it, or make it smaller (fewer "
            "algorithms, budgets, seeds or rounds)."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StudyError(f"Cannot create the study directory {folder}: {exc.strerror or exc}.") from exc
    with RunLock(folder, "fedaudit compare"):
        remove_stale_temporaries(folder, ("",))  # what an interrupted compare left beside study.json
        _claim(folder, study, [run.name for run in planned])
        return _carry_out(folder, study, planned, setups, actions, attack, policy, progress=progress, echo=echo)


def _carry_out(
    folder: Path,
    study: Study,
    planned: list[PlannedRun],
    setups: list[Setup],
    actions: list[str],
    attack: AttackOptions,
    policy: Policy | None,
    *,
    progress: bool,
    echo: Echo,
) -> ReportOutcome:
    """Train, attack and report every run of a checked study (under the study's lock)."""
    directories = []
    with tqdm(total=2 * len(planned), desc="study", unit="step", disable=not progress) as bar:
        for index, (run, setup, action) in enumerate(zip(planned, setups, actions), start=1):
            say = functools.partial(_say, echo, f"[{index}/{len(planned)}] {run.name}")
            directory = folder / RUNS_DIR / run.name
            bar.set_postfix_str(f"train {run.name}")
            say(_train(directory, setup, action, say))
            bar.update()
            bar.set_postfix_str(f"attack {run.name}")
            own = attack_for(attack, setup.config)
            if own is not attack:
                say(
                    "no canary audit: the run has no canaries (it has no DP, or is client level without canary clients)"
                )
            if own is None:
                say("no attack asked for applies to this run")
            elif results_current(directory, own):
                _settle_results(directory)
                say("attack results are up to date")
            else:
                run_attacks([directory], own, echo=say)
            stale = _prune_results(directory, own)
            if stale:
                say(f"removed attack results the study no longer asks for: {', '.join(stale)}")
            bar.update()
            directories.append(directory)
    return write_report(collect_runs(directories), folder, study.formats, policy, folder_only=True)


def _settle_results(directory: Path) -> None:
    """Finish a run whose attack results are all written but whose last commit may not be: a compare killed after
    the attack wrote its last result and before manifest.json committed it leaves the commit pending and a
    half-written manifest beside it. Under the run's own lock (which clears such temporaries), the results are
    committed as they are if every file checks, as the attack's own next commit would."""
    run = RunDirectory(directory)
    with run.lock("fedaudit compare"):
        remove_stale_temporaries(directory, ("attacks",))
        run.seal.check("attack")
        run.settle()


def _say(echo: Echo, prefix: str, line: str) -> None:
    echo(f"{prefix}: {line}")


def _check_folder(folder: Path) -> None:
    """``folder`` must be new, empty, or a study directory (with study.json)."""
    if folder.exists() and not folder.is_dir():
        raise StudyError(f"--out {folder} exists and is not a directory.")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / STUDY_FILE).is_file():
        raise StudyError(
            f"--out {folder} is a non-empty directory without {STUDY_FILE}, so it is not a fedaudit study; "
            "choose another --out."
        )


def _claim(folder: Path, study: Study, names: list[str]) -> None:
    """Record the study in ``folder``/study.json (keeping when the study directory was created)."""
    record = folder / STUDY_FILE
    created = now_iso()
    if record.is_file():
        try:
            created = RunDirectory(folder).read_json(record).get("created", created)
        except (RunError, AttributeError):
            pass
    atomic_write_json(
        record,
        {
            "format": STUDY_FORMAT,
            "format_version": 1,
            "created": created,
            "updated": now_iso(),
            "study": study.to_dict(),
            "runs": names,
        },
    )


def _action(directory: Path, setup: Setup, overwrite: bool) -> str:
    """What the run at ``directory`` needs: "train", "retrain", "resume" or "keep" (checked before anything runs)."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise StudyError(
            f"{directory} is {'a symbolic link' if directory.is_symlink() else 'not a directory'}, where the study "
            "keeps one of its runs: remove it (the study will train the run there)."
        )
    run = RunDirectory(directory)
    if not run.is_run():
        return "retrain" if directory.exists() else "train"  # a run that crashed before its manifest: nothing to keep
    try:
        stored = run.read_run_config().to_dict()
        done = run.read_manifest().rounds_done
    except RunError:
        stored, done = None, 0
    if _comparable(stored) != _comparable(setup.config.to_dict()):
        if not overwrite:
            raise StudyError(
                f"{directory} holds a run whose configuration differs from the one the study plans; "
                "remove it, or pass --overwrite to retrain it."
            )
        return "retrain"
    return "keep" if done == setup.config.federated.rounds else "resume"


@dataclass(frozen=True)
class Estimate:
    """How long a study's remaining work should take on this machine, and what that rests on."""

    train_seconds: float
    attack_seconds: float
    round_seconds: dict[str, float]  # one measured first round, by algorithm label
    to_train: int
    rounds_left: int

    @property
    def seconds(self) -> float:
        return self.train_seconds + self.attack_seconds

    def lines(self, planned: int, kept: int) -> list[str]:
        """The plan as the study prints it before it starts."""
        measured = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.round_seconds.items())
        lines = [
            f"plan: {planned} run{'s' * (planned != 1)}, {self.to_train} to train or resume ({self.rounds_left} "
            f"rounds in all), {kept} kept as they are"
        ]
        if self.seconds > 0:
            lines.append(
                f"estimated time here: about {_duration(self.seconds)} (training {_duration(self.train_seconds)}, "
                f"attacks {_duration(self.attack_seconds)}; from one first round timed per algorithm"
                + (f": {measured}" if measured else "")
                + ")"
            )
        return lines


def estimate_study(
    planned: Sequence[PlannedRun],
    setups: Sequence[Setup],
    actions: Sequence[str],
    folder: Path,
    attack: AttackOptions,
    *,
    echo: Echo | None = None,
) -> Estimate:
    """Time one first round of each algorithm (with or without DP) that still has rounds to train, and the attacks'
    signals on a few hundred records, and scale them to the study's remaining rounds and attacked records."""
    per_round: dict[tuple[str, bool], float] = {}
    labels: dict[str, float] = {}
    train = attacks = 0.0
    to_train = rounds_left = 0
    signal_seconds: float | None = None
    rebuild_seconds: dict[tuple[str, bool], float] = {}

    def first_round(setup: Setup) -> float:
        if not per_round and echo is not None:  # the first timing: say what the wait is
            echo(
                "timing a first round of each algorithm, with and without DP, to estimate the study's time "
                "(Ctrl-C stops)"
            )
        return time_first_round(setup)

    for run, setup, action in zip(planned, setups, actions):
        directory = folder / RUNS_DIR / run.name
        rounds = setup.config.federated.rounds
        own = attack_for(attack, setup.config)
        key = (setup.config.federated.algorithm, setup.config.privacy.dp)
        left = 0 if action == "keep" else rounds
        if action == "resume":
            left = rounds - RunDirectory(directory).read_manifest().rounds_done
        if left:
            if key not in per_round:
                per_round[key] = first_round(setup)
                labels[algorithm_label(*key)] = per_round[key]
            train += per_round[key] * left
            to_train += 1
            rounds_left += left
        if own is not None and (left or not results_current(directory, own)):
            if signal_seconds is None:
                signal_seconds = _time_signals(setup, attack)
            records = 2 * min(attack.max_records, sum(len(c) for c in setup.partition.clients))
            attacks += signal_seconds * records
            if attack.of(REFERENCE):  # reference models: a run's training each, kept runs' too
                if key not in per_round:
                    per_round[key] = first_round(setup)
                    labels[algorithm_label(*key)] = per_round[key]
                attacks += attack.references * per_round[key] * rounds
            if RECONSTRUCTION in attack.methods:
                if key not in rebuild_seconds:
                    rebuild_seconds[key] = _time_reconstruction(setup, attack)
                attacks += rebuild_seconds[key]
    return Estimate(train, attacks, labels, to_train, rounds_left)


def _time_reconstruction(setup: Setup, attack: AttackOptions) -> float:
    """Seconds of a run's reconstruction audit: every client of the attacked rounds, each update timed on a few
    iterations of the attack and scaled (:func:`fedaudit.attacks.reconstruction.attack.estimate_seconds`)."""
    from fedaudit.attacks.reconstruction.attack import estimate_seconds, parse_target
    from fedaudit.preparation import clients_per_round

    config = setup.config
    rounds, client = parse_target(attack.target)
    attacked = {"first-final": min(2, config.federated.rounds), "all": config.federated.rounds}.get(rounds, 1)
    per_round = (
        1 if client is not None else clients_per_round(config.federated.client_fraction, config.data.num_clients)
    )
    records = round(sum(len(c) for c in setup.partition.clients) / len(setup.partition.clients))
    return estimate_seconds(config, setup.spec, setup.dataset, records, attacked * per_round, attack.reconstruction)


def _time_signals(setup: Setup, attack: AttackOptions) -> float:
    """Seconds per record of the attacks' loss and gradient-norm signals with the run's model, on 256 records."""
    from fedaudit.attacks.membership.signals import compute_signals
    from fedaudit.models import build_model

    model = build_model(setup.spec).to(setup.device)
    x, y = setup.dataset.train_x[:256], setup.dataset.train_y[:256]
    signals = [name for name in ("loss", "grad-norm") if name in attack.signals] or ["loss"]
    began = time.perf_counter()
    compute_signals(model, x, y, signals, device=setup.device)
    return (time.perf_counter() - began) / max(len(x), 1)


def _duration(seconds: float) -> str:
    """A duration in words: seconds under two minutes, minutes under two hours, else hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _train(directory: Path, setup: Setup, action: str, echo: Echo) -> str:
    """Carry out :func:`_action`'s verdict (``echo`` gets a line per round); returns what was done, in words."""
    if action == "keep":
        return f"complete ({setup.config.federated.rounds} rounds), kept"
    if action == "resume":
        done = RunDirectory(directory).read_manifest().rounds_done
        result = resume(directory, device=setup.config.device, progress=False, echo=echo)
        return f"resumed from round {done}: {_outcome(result.test_accuracy, result.epsilon)}"
    if action == "retrain":
        shutil.rmtree(directory)
    result = train_setup(setup, directory, progress=False, echo=echo)
    return f"trained {result.rounds_done} rounds: {_outcome(result.test_accuracy, result.epsilon)}"


def attack_for(attack: AttackOptions, config: RunConfig) -> AttackOptions | None:
    """The study's attack options for one of its runs: the canary audit only where the run has canaries to audit (a
    run without DP has none, nor a client-level run without canary clients: a budget of none or client level drops
    the base's record-level canaries); None when nothing asked for is left."""
    privacy, audit = config.privacy, config.audit
    if not attack.of(CANARY) or (privacy.dp and (audit.canary_clients if privacy.client_level else audit.canaries)):
        return attack
    methods = tuple(m for m in attack.methods if family_of(m) != CANARY)
    return replace(attack, methods=methods) if methods else None


def _prune_results(directory: Path, options: AttackOptions | None) -> list[str]:
    """Remove attack results of this study's run that the study no longer asks for (every one, for ``options``
    None), so its report shows only the study."""
    run = RunDirectory(directory)
    expected = set(expected_results(run, options)) if options is not None else set()
    folder = run.attacks_dir
    stale = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name not in expected) if folder.is_dir() else []
    with run.staged():
        run.remove([p for name in stale for p in (folder / name).rglob("*") if p.is_file()])
    for name in stale:
        shutil.rmtree(folder / name)  # what is left: empty folders, temporaries
    return stale


def _comparable(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """A configuration without the fields that do not change results (where it trains, which engine runs the
    clients, how many at once, where Flower runs them)."""
    volatile = ("device", "engine", "parallel_clients", "flower")
    return None if config is None else {key: value for key, value in config.items() if key not in volatile}


def _outcome(accuracy: float, epsilon: float) -> str:
    return f"test accuracy {accuracy:.4f}, " + ("no DP" if math.isinf(epsilon) else f"epsilon {epsilon:.3f}")


def skipped_runs(study: Study) -> list[str]:
    """The (algorithm, budget) pairs a study does not train, in words: client-level budgets of algorithms without a
    client level."""
    return [
        f"{algorithm} at {budget} (it has no client level)"
        for budget in study.budgets
        for algorithm in study.algorithms
        if budget.client_level and not ALGORITHMS[algorithm].client_dp
    ]


def study_from_options(
    study_file: str | None,
    *,
    algorithms: Sequence[str],
    budgets: Sequence[str],
    seeds: Sequence[int],
    equal_data_access: bool | None,
    max_update_norm: float | None = None,
    config_file: str | None,
    base_overrides: Mapping[str, Any],
    attack_overrides: Mapping[str, Any],
    formats: Sequence[str],
    policy: str | None,
    audits: Sequence[str] = (),
) -> Study:
    """The study of ``fedaudit compare``: the study file (or the defaults) with the command line's options on top;
    ``audits`` (``--attack reconstruction``) join the attack methods."""
    study = load_study(study_file) if study_file else Study()
    base = load_config_file(config_file) if config_file else study.base
    base = base.with_overrides(base_overrides)
    known = {f.name for f in fields(AttackOptions)}
    attack = replace(study.attack, **{k: v for k, v in attack_overrides.items() if k in known and v not in (None, ())})
    for audit in audits:
        if audit != RECONSTRUCTION:
            raise StudyError(f"Unknown --attack {audit!r}; choose {RECONSTRUCTION}.")
    attack = replace(attack, methods=tuple(dict.fromkeys((*attack.methods, *audits))))
    return replace(
        study,
        algorithms=tuple(dict.fromkeys(algorithms)) or study.algorithms,
        budgets=tuple(Budget.parse(b) for b in budgets) or study.budgets,
        seeds=tuple(dict.fromkeys(seeds)) or study.seeds,
        equal_data_access=study.equal_data_access if equal_data_access is None else equal_data_access,
        max_update_norm=study.max_update_norm if max_update_norm is None else max_update_norm,
        base=base,
        attack=attack,
        formats=tuple(f.lower() for f in formats) or study.formats,
        policy=policy or study.policy,
    )

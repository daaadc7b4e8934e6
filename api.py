"""fedaudit as a library: the five commands as functions, and the audit's estimators for scores from anywhere.

``train``, ``attack``, ``verify``, ``report`` and ``compare`` take the configuration the command line takes (the
same option names, as keyword arguments; a configuration file or a :class:`~fedaudit.config.RunConfig`) and return
typed results instead of printing tables; the command line is a thin layer over them. Errors a user can cause are
:class:`~fedaudit.errors.UserError` subclasses whose message is one sentence.

The estimators need nothing of fedaudit's runs: give them the scores of canaries (or records) that were included and
of those that were not, from any DP library, and they return lower bounds on epsilon or an estimate of it
(docs/python-api.md has a worked example).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from fedaudit.attacks.canary.estimators import CanaryBound, GaussianEstimate, gaussian_estimate, split_audit
from fedaudit.attacks.metrics import CONFIDENCE, EpsilonBound, auc_score, epsilon_lower_bound
from fedaudit.config import ConfigError, RunConfig, load_config_file, option_field

if TYPE_CHECKING:  # each command imports what it runs when called (torch among it), so importing this is quick
    from fedaudit.attacks.conformance.verify import VerifyOutcome
    from fedaudit.attacks.runner import AttackResult
    from fedaudit.reports.render import ReportOutcome
    from fedaudit.study import Study
    from fedaudit.training import TrainResult

__all__ = [
    "CanaryBound",
    "EpsilonBound",
    "GaussianEstimate",
    "attack",
    "auc_score",
    "compare",
    "epsilon_from_gdp",
    "epsilon_lower_bound",
    "epsilon_one_run",
    "gaussian_estimate",
    "report",
    "resume",
    "run_config",
    "train",
    "verify",
]

Echo = Callable[[str], None]


def run_config(config: RunConfig | str | Path | None = None, **options: Any) -> RunConfig:
    """A run's configuration as ``fedaudit train`` builds it: ``config`` (a :class:`RunConfig`, or the path of a
    YAML or JSON configuration file such as a run's config.json), with ``options`` on top, named as ``train``'s
    command-line options are (``rounds=3``, ``dp=True``, ``target_epsilon=8``); ``None`` leaves a setting as it is.

    A configuration whose noise multiplier was calibrated for a target epsilon is calibrated afresh for the new
    settings, unless ``noise_multiplier`` is given (it then replaces the target).

    Raises:
        ConfigError: a setting that cannot work (one sentence naming it).
        TrainingError: a setting that only other algorithms read (it would be ignored).
    """
    if config is None:
        base = RunConfig()
    elif isinstance(config, RunConfig):
        base = config
    else:
        base = load_config_file(str(config), validate=False)
    if base.privacy.calibrated:
        # A config.json of a --target-epsilon run: its sigma was calibrated for that run's rounds, rates and budget.
        # A noise multiplier given replaces the budget; otherwise sigma is calibrated afresh (the same configuration
        # gives the same sigma), so no setting on top can push epsilon past the target.
        forget = {"target_epsilon": None} if options.get("noise_multiplier") is not None else {"noise_multiplier": None}
        base = dataclasses.replace(base, privacy=dataclasses.replace(base.privacy, calibrated=False, **forget))
    overrides = {}
    for name, value in options.items():
        try:
            overrides[option_field(name)] = value
        except KeyError:
            raise ConfigError(
                f"No setting is called {name!r}; the names are train's options with '_' for '-' (see docs/train.md)."
            ) from None
    base = base.with_overrides(overrides)
    base.validate()  # the file and the options together: an option may complete what the file leaves open
    from fedaudit.preparation import refuse_unread

    refuse_unread([name for name, value in options.items() if value is not None], base.federated.algorithm)
    return base


def _paths(runs: str | Path | Sequence[str | Path]) -> list[str | Path]:
    """One run directory or several, as a list; none at all is a mistake (the command line refuses it too)."""
    paths = [runs] if isinstance(runs, (str, Path)) else list(runs)
    if not paths:
        from fedaudit.errors import UserError

        raise UserError("Give at least one run directory.")
    return paths


def train(
    config: RunConfig | str | Path | None = None,
    out: str | Path | None = None,
    *,
    overwrite: bool = False,
    progress: bool = False,
    echo: Echo = tqdm.write,
    **options: Any,
) -> TrainResult:
    """Train a federated model and write its run directory to ``out`` (``fedaudit train``).

    Args:
        config: a :class:`RunConfig` or a configuration file; ``options`` go on top (see :func:`run_config`).
        out: the run directory to create.
        overwrite: replace an existing run at ``out`` (never a directory that is not a run).
        progress: show progress bars.
        echo: receives one line per round (accuracy, loss, epsilon, time, bytes sent); by default printed above
            the progress bars.

    Returns:
        The run directory, the rounds done, the final test accuracy and epsilon (infinite without DP).
    """
    from fedaudit import training
    from fedaudit.preparation import TrainingError

    if out is None:
        raise TrainingError("--out is required: the directory the run is written to.")
    if not isinstance(config, RunConfig) or options:
        config = run_config(config, **options)  # a RunConfig as it is: training checks it completely before writing
    return training.train(config, out, overwrite=overwrite, progress=progress, echo=echo)


def resume(
    run_dir: str | Path,
    *,
    rounds: int | None = None,
    device: str | None = None,
    progress: bool = False,
    echo: Echo = tqdm.write,
    **settings: Any,
) -> TrainResult:
    """Continue an interrupted run from its last committed round, or extend a complete one to ``rounds``
    (``fedaudit train --resume``); byte-identical to an uninterrupted run. ``settings`` are those of where the
    clients run (``parallel_clients``, ``ray_address``, ``superlink``, ...), never of what they compute."""
    from fedaudit import training

    return training.resume(run_dir, rounds=rounds, device=device, settings=settings, progress=progress, echo=echo)


def attack(
    runs: str | Path | Sequence[str | Path],
    *,
    signals: Sequence[str] = (),
    methods: Sequence[str] = (),
    iterations: int | None = None,
    restarts: int | None = None,
    psnr_threshold: float | None = None,
    progress: bool = False,
    echo: Echo = print,
    **options: Any,
) -> list[AttackResult]:
    """Attack runs and write each result under ``RUN/attacks/`` (``fedaudit attack``).

    Args:
        runs: one run directory or several.
        signals, methods: as ``--signal`` and ``--method`` (by default the command's defaults).
        iterations, restarts, psnr_threshold: the reconstruction attack's settings.
        progress: show progress bars.
        echo: receives what the command prints while it works.
        options: ``attack``'s other options by their field names (``target``, ``max_records``, ``bootstrap``,
            ``seed``, ``device``, ...; see :class:`fedaudit.attacks.runner.AttackOptions`).

    Returns:
        One result per attack, signal and target, each with its metrics (AUC, intervals, epsilon lower bound).
    """
    from fedaudit.attacks import AttackError
    from fedaudit.attacks.options import DEFAULT_SIGNALS, AttackOptions, ReconstructionOptions
    from fedaudit.attacks.registry import DEFAULT_METHODS
    from fedaudit.attacks.runner import run_attacks
    from fedaudit.options import option_name

    reconstruction = {"iterations": iterations, "restarts": restarts, "psnr_threshold": psnr_threshold}
    fields = [each for each in dataclasses.fields(AttackOptions) if each.name not in ("signals", "methods")]
    by_option = {option_name(each): each.name for each in fields if each.name != "reconstruction"}  # bootstrap
    known = {**{each.name: each.name for each in fields if each.name != "reconstruction"}, **by_option}
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise AttackError(f"No attack option is called {unknown[0]!r}; the names are: {', '.join(sorted(known))}.")
    options = {known[name]: value for name, value in options.items()}
    chosen = AttackOptions(
        signals=tuple(dict.fromkeys(signals or DEFAULT_SIGNALS)),
        methods=tuple(dict.fromkeys(methods or DEFAULT_METHODS)),
        reconstruction=ReconstructionOptions(**{k: v for k, v in reconstruction.items() if v is not None}),
        progress=progress,
        **options,
    )
    return run_attacks(_paths(runs), chosen, echo=echo)


def verify(
    runs: str | Path | Sequence[str | Path],
    *,
    seed: int = 0,
    public_key: bytes | None = None,
    probe: bool = False,
) -> Iterator[VerifyOutcome]:
    """Check runs (``fedaudit verify``): each run's outcome, in the order given, with its integrity, its signature
    (with ``public_key``, raw Ed25519 bytes), and for a DP canary run the recomputed mechanism checks; writes
    ``RUN/verification.json``. Every run is checked before the first outcome is returned."""
    from fedaudit.attacks.conformance.verify import verify_runs

    return iter(verify_runs(_paths(runs), seed=seed, public_key=public_key, probe=probe))


def report(
    runs: str | Path | Sequence[str | Path],
    out: str | Path,
    *,
    formats: Sequence[str] = (),
    policy: str | Path | None = None,
    overwrite: bool = False,
) -> ReportOutcome:
    """Write the privacy report of runs to ``out`` (``fedaudit report``): what was written, and with a ``policy``
    file its checks and verdict (PASS, FAIL or INCONCLUSIVE)."""
    from fedaudit.reports.build import build_report

    return build_report(_paths(runs), out=out, formats=formats, policy_file=policy, overwrite=overwrite)


def compare(
    study: Study | str | Path,
    out: str | Path,
    *,
    overwrite: bool = False,
    progress: bool = False,
    yes: bool = True,
    echo: Echo = tqdm.write,
) -> ReportOutcome:
    """Run a whole study (``fedaudit compare``): train, attack and report each run, then the comparison report;
    what is already done is kept. ``study`` is a :class:`Study` or a study file. Unlike the command, a study
    estimated to take more than 10 minutes starts without asking (``yes=False`` refuses it)."""
    from fedaudit.study import Study, load_study, run_study

    chosen = study if isinstance(study, Study) else load_study(study)
    return run_study(chosen, out, overwrite=overwrite, progress=progress, echo=echo, yes=yes)


def epsilon_one_run(
    included: Any, excluded: Any, *, delta: float, confidence: float = CONFIDENCE, seed: int = 0
) -> CanaryBound:
    """The one-run lower bound on epsilon (Steinke, Nasr and Jagielski 2023), valid at ``confidence`` whatever the
    scores' distribution: its threshold is chosen on a random half of the included and of the excluded canaries
    (drawn with ``seed``) and the bound judged on the other half, as ``fedaudit attack --method canary`` does.
    Choosing the threshold and judging it on the same canaries is not valid: on scores independent of inclusion it
    exceeded 0 in 7% of trials at 95%."""
    return split_audit(included, excluded, estimator="one-run", delta=delta, confidence=confidence, seed=seed)


def epsilon_from_gdp(
    included: Any, excluded: Any, *, delta: float, confidence: float = CONFIDENCE, seed: int = 0
) -> CanaryBound:
    """A lower bound on epsilon from a lower bound on the Gaussian-DP parameter mu (Nasr et al. 2023), split as
    :func:`epsilon_one_run`. It holds for mechanisms whose trade-off curve is Gaussian (the Gaussian mechanism, and
    DP-SGD's subsampled Gaussian at the false-positive rates a few thousand canaries resolve), not for any mechanism:
    on randomised response or Laplace noise it exceeds their epsilon (use :func:`epsilon_one_run` there)."""
    return split_audit(included, excluded, estimator="gdp", delta=delta, confidence=confidence, seed=seed)

"""The ``fedaudit`` command line: parse, validate, call the packages.

Errors a user can cause end with one sentence on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from fedaudit.attacks.options import AttackOptions, ReconstructionOptions
from fedaudit.config import DataConfig, option_field, option_fields
from fedaudit.errors import USER_ERROR_EXIT, UserError
from fedaudit.options import GROUPS, help_text, option_name, option_of, shown_default
from fedaudit.registry import ACCOUNTANT_HELP, ACCOUNTANTS, DEFAULT_ACCOUNTANT
from fedaudit.study_settings import StudySettings


def user_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the packages' user-facing errors into one sentence on stderr and exit code 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            click.echo(f"Error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def show_progress(progress: bool | None) -> bool:
    """Progress bars by default only on a terminal: in a log they would be carriage-return frames (the round summaries
    are printed either way)."""
    return sys.stderr.isatty() if progress is None else progress


class OneSentenceGroup(click.Group):
    """A click group whose usage errors (unknown option or choice, bad value) are one sentence and exit code 2,
    without the usage lines click adds."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            click.echo(f"Error: {exc.format_message()}", err=True)
            sys.exit(USER_ERROR_EXIT)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


class GroupedOption(click.Option):
    """An option that --help lists under its ``group`` (a concern: Data, Privacy, Engine, ...)."""

    def __init__(self, *args: Any, group: str = "Run", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group


class GroupedCommand(click.Command):
    """A command whose --help lists its options by concern, in :data:`fedaudit.options.GROUPS`' order."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(getattr(param, "group", "Run"), []).append(record)
        order = [title for title in GROUPS if title in groups] + [title for title in groups if title not in GROUPS]
        for title in order:
            with formatter.section(f"{title} options"):
                formatter.write_dl(groups[title])


_TYPES = {"int": int, "float": float, "str": str, "Budget": str}  # a budget is parsed with the study


def _field_option(
    field: dataclasses.Field, group: str, *, defaults: bool, by_field: bool | None = None
) -> Callable[[Any], Any]:
    """The click option of one dataclass field, from its metadata (fedaudit.options): name, help with the shown
    default, type from the field's annotation, choices, flag or path. With ``defaults`` an option not given takes
    the field's default (``attack``'s options); without, it is None (a flag's too), so that a configuration file's
    value stands (``train``'s and ``compare``'s). Its parameter is named after the field with ``by_field`` (by
    default with ``defaults``), else after the option (``--lr``: ``lr``)."""
    option = option_of(field)
    assert option is not None
    name = "--" + option_name(field).replace("_", "-")
    annotation = str(field.type).split(" | ")[0]
    kwargs: dict[str, Any] = {"cls": GroupedOption, "group": group, "help": help_text(field)}
    parameter = [field.name] if (defaults if by_field is None else by_field) else []
    if option.metavar is not None:
        kwargs["metavar"] = option.metavar
    if annotation == "bool":
        declarations = [f"{name}/--no-{name[2:]}"] if option.negatable else [name]
        kwargs.update(is_flag=True, default=field.default if defaults else None)
    else:
        declarations = [name]
        if option.choices is not None:
            kwargs["type"] = click.Choice(list(option.choices))
        elif option.path is not None:
            kwargs["type"] = click.Path(file_okay=option.path == "file", dir_okay=option.path == "dir")
        else:
            kwargs["type"] = _TYPES[annotation.removeprefix("tuple[").split(",")[0]]
        kwargs["multiple"] = option.multiple
        if defaults and not option.multiple:
            kwargs["default"] = field.default
    return click.option(*declarations, *parameter, **kwargs)


def config_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add an option for every configuration field that has one (fedaudit.config.option_fields), grouped by
    concern: the command line's settings, help texts and shown defaults are the configuration's own."""
    for _, field, group in reversed(option_fields()):
        command = _field_option(field, group, defaults=False)(command)
    return command


def attack_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add an option for every field of the attacks' options that has one (fedaudit.attacks.options), with the
    fields' defaults."""
    chosen = [f for kind in (AttackOptions, ReconstructionOptions) for f in dataclasses.fields(kind) if option_of(f)]
    for field in reversed(chosen):
        command = _field_option(field, "Attack", defaults=True)(command)
    return command


def study_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add an option for every setting of a study of its own (fedaudit.study_settings), None when not given so that
    a study file's value stands, each parameter named after its field (``--algorithm``: ``algorithms``)."""
    for field in reversed([f for f in dataclasses.fields(StudySettings) if option_of(f)]):
        command = _field_option(field, "Study", defaults=False, by_field=True)(command)
    return command


def _shown(kind: type, name: str) -> str | None:
    """The default --help shows for the option of ``kind``'s field ``name`` (where another command repeats it:
    compare's attack options, datasets' --image-size)."""
    (field,) = [f for f in dataclasses.fields(kind) if f.name == name]
    return shown_default(field)


@click.group(cls=OneSentenceGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="fedaudit")
def main() -> None:
    """fedaudit: train federated models with record-level DP and audit how much they leak.

    The flow is train, then attack, then report (or compare for a whole study). The algorithms, the accountant,
    the audit and the run directory are described in docs/ (algorithms.md, accounting.md, audit.md,
    run-directory.md).
    """


@main.command(cls=GroupedCommand)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML or JSON file with the configuration (sections data, model, federated, privacy); options given "
    "here override it.",
)
@click.option(
    "--equal-data-access",
    is_flag=True,
    help="Print the DP-FedAvg settings with the same DP queries per round as this configuration, and exit.",
)
@click.option("--out", type=click.Path(), help="Run directory to create.")
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(),
    help="Continue the interrupted run in this directory (only --rounds, --device and where clients run may change).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing run at --out.")
@click.option("--progress/--no-progress", default=None, help="Show progress bars. [default: only on a terminal]")
@config_options
@click.pass_context
@user_errors
def train(
    ctx: click.Context,
    config_file: str | None,
    out: str | None,
    resume_dir: str | None,
    overwrite: bool,
    progress: bool | None,
    equal_data_access: bool,
    **options: Any,
) -> None:
    """Train a federated model and write a run directory (config, membership, metrics, ledger, weights).

    Options and examples: docs/train.md; what each algorithm computes: docs/algorithms.md; every file of the run
    directory: docs/run-directory.md.
    """
    from fedaudit import api
    from fedaudit.preparation import TrainingError, data_access, refuse_unread
    from fedaudit.training import RESUME_SETTINGS, refuse_resume_settings

    progress = show_progress(progress)
    given = {name for name in options if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}
    options["site_data"] = options.get("site_data") or None  # not given: the configuration file's, if any
    if resume_dir is not None:
        also = {"config": config_file, "out": out, "overwrite": overwrite}
        refuse_resume_settings([*given, *(name for name, value in also.items() if value)])
        result = api.resume(
            resume_dir,
            rounds=options.get("rounds"),
            device=options.get("device"),
            progress=progress,
            **{name: options.get(name) for name in RESUME_SETTINGS},
        )
    else:
        if out is None and not equal_data_access:
            raise TrainingError("--out is required: the directory the run is written to.")
        config = api.run_config(config_file, **options)
        refuse_unread(given, config.federated.algorithm)  # what the configuration file set as well
        if equal_data_access:
            for line in data_access(config).lines():
                click.echo(line)
            return
        result = api.train(config, out, overwrite=overwrite, progress=progress)
    eps = f", epsilon {result.epsilon:.3f}" if result.epsilon != float("inf") else ""
    click.echo(f"Run written to {Path(result.run_dir)} (test accuracy {result.test_accuracy:.4f}{eps})")
    from fedaudit.rundir import RunDirectory

    privacy = RunDirectory(result.run_dir).read_run_config().privacy
    if privacy.calibrated:
        click.echo(
            f"Noise multiplier {privacy.noise_multiplier:.6g}, calibrated for --target-epsilon "
            f"{privacy.target_epsilon:g} "
            + (
                "per client over every round, at the server's client sampling rate."
                if privacy.client_level
                else "over the rounds each client takes part in."
            )
        )


@main.command()
@click.option("--noise-multiplier", type=click.FloatRange(min=0), help="sigma of the Sampled Gaussian Mechanism.")
@click.option(
    "--target-epsilon",
    type=click.FloatRange(min=0, min_open=True),
    help="Instead of sigma: print the smallest sigma reaching this epsilon.",
)
@click.option("--sample-rate", type=click.FloatRange(0, 1, min_open=True), required=True, help="q = B / N_k.")
@click.option("--steps", type=click.IntRange(min=1), required=True, help="DP queries per client per round T.")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    required=True,
    help="Rounds M the client takes part in (each charged in full).",
)
@click.option("--client-fraction", type=float, default=None, hidden=True)
@click.option(
    "--delta",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=1e-5,
    show_default=True,
    help="delta of (epsilon, delta)-DP.",
)
@click.option(
    "--accountant",
    type=click.Choice(list(ACCOUNTANTS)),
    default=DEFAULT_ACCOUNTANT,
    show_default=True,
    help=ACCOUNTANT_HELP + ".",
)
@user_errors
def epsilon(
    noise_multiplier: float | None,
    target_epsilon: float | None,
    sample_rate: float,
    steps: int,
    rounds: int,
    client_fraction: float | None,
    delta: float,
    accountant: str,
) -> None:
    """Epsilon after each round a DP-SGD client takes part in (see docs/accounting.md)."""
    import pandas as pd

    from fedaudit.privacy.accounting import AccountingError, calibrate_noise_multiplier, epsilon_per_round

    if client_fraction is not None:
        raise AccountingError(
            "--client-fraction no longer lowers epsilon: the server knows which clients it selected, so client "
            "sampling hides nothing; give the number of rounds the client takes part in as --rounds."
        )
    if (noise_multiplier is None) == (target_epsilon is None):
        raise AccountingError("Give exactly one of --noise-multiplier and --target-epsilon.")
    common = dict(
        sample_rate=sample_rate,
        queries_per_round=steps,
        rounds=rounds,
        delta=delta,
        accountant=accountant,
    )
    sigma = (
        noise_multiplier
        if target_epsilon is None
        else calibrate_noise_multiplier(target_epsilon=target_epsilon, **common)
    )
    eps = epsilon_per_round(noise_multiplier=sigma, **common)
    table = pd.DataFrame({"round": range(1, rounds + 1), "epsilon": eps})
    click.echo(f"accountant={accountant} delta={delta:g} sigma={sigma:.6g} q={sample_rate:g} T={steps}")
    click.echo(table.to_string(index=False))
    if target_epsilon is None:
        click.echo(f"epsilon={eps[-1]:.6g}")
    else:
        click.echo(f"noise_multiplier={sigma:.6g}")


@main.command()
@click.argument("run_dirs", nargs=-1, type=click.Path())
@click.option(
    "--flower-log",
    help="Audit a Flower app's canary log (fedaudit.flower.CanaryClients) instead of runs; takes --out, --seed and "
    "--bootstrap only (docs/flower-apps.md).",
)
@click.option("--out", help="--flower-log: the results folder. [default: beside the log, named LOG-audit]")
@attack_options
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Show a progress bar while signals are computed. [default: only on a terminal]",
)
@click.option(
    "--superlink",
    metavar="HOST:PORT",
    help="A run whose sites keep their records (--dataset sites on a Flower deployment): the SuperLink through "
    "which each site scores its own records (docs/deployment.md).",
)
@click.option(
    "--root-certificates", type=click.Path(dir_okay=False), help="With --superlink: the CA certificate of its TLS."
)
@click.option("--insecure", is_flag=True, default=False, help="With --superlink: talk to it without TLS.")
@user_errors
def attack(run_dirs: tuple[str, ...], signals: tuple[str, ...], methods: tuple[str, ...], **options: Any) -> None:
    """Membership inference and reconstruction attacks on runs; results go to
    RUN_DIR/attacks/<signal>-<method>[-round-N]/ and RUN_DIR/attacks/reconstruction-round-N-client-K/.

    Options and examples: docs/attack.md; signals, methods, intervals and the epsilon lower bound: docs/audit.md.
    """
    flower_log, out = options.pop("flower_log"), options.pop("out")
    if flower_log is not None or out is not None:
        _attack_flower_log(run_dirs, signals, methods, flower_log, out, options)
        return
    if not run_dirs:
        raise UserError("Give at least one run directory, or --flower-log LOG.")
    from fedaudit import api
    from fedaudit.attacks.reconstruction.attack import console_table
    from fedaudit.attacks.runner import results_table

    options["progress"] = show_progress(options["progress"])
    options["sites"] = _site_connection(
        options.pop("superlink"), options.pop("root_certificates"), options.pop("insecure")
    )
    results = api.attack(run_dirs, signals=signals, methods=methods, echo=click.echo, **options)
    membership = results_table(results)
    if not membership.empty:
        click.echo(membership.to_string(index=False, float_format=lambda v: f"{v:.3f}", na_rep="-"))
    rebuilt = [r.metrics for r in results if r.metrics.get("method") == "reconstruction"]
    if rebuilt:
        click.echo(console_table(rebuilt).to_string(index=False))


def _attack_flower_log(
    run_dirs: tuple[str, ...],
    signals: tuple[str, ...],
    methods: tuple[str, ...],
    flower_log: str | None,
    out: str | None,
    options: dict[str, Any],
) -> None:
    """``attack --flower-log LOG``: the canary audit of a Flower app's log (docs/flower-apps.md)."""
    from fedaudit.attacks.canary.flower_log import audit_log, check_out, console_table, default_out, write_results
    from fedaudit.config import MAX_SEED

    if flower_log is None:
        raise UserError("--out is for --flower-log; the results of runs go to RUN_DIR/attacks/.")
    if run_dirs:
        raise UserError("--flower-log audits a log, not run directories: give one or the other.")
    ctx = click.get_current_context()
    given = [name for name in options if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
    extra = sorted({*given, *(["signal"] if signals else []), *(["method"] if methods else [])} - {"seed", "resamples"})
    if extra:
        names = ", ".join("--bootstrap" if n == "resamples" else "--" + n.replace("_", "-") for n in extra)
        raise UserError(f"--flower-log takes --out, --seed and --bootstrap only, not {names}.")
    seed, resamples = options["seed"], options["resamples"]
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed must be in [0, {MAX_SEED}], got {seed}.")
    if resamples < 1:
        raise UserError(f"--bootstrap must be at least 1, got {resamples}.")
    if out == "":
        raise UserError("--out needs a folder for the results.")
    target = Path(out) if out is not None else default_out(flower_log)
    check_out(target)
    audit = audit_log(flower_log, seed=seed, resamples=resamples)
    write_results(audit, target)
    click.echo(console_table(audit))
    click.echo(f"Results: {target}")


def _site_connection(superlink: str | None, certificates: str | None, insecure: bool) -> Any:
    """How ``fedaudit attack`` reaches the sites of a run that keeps its records there, or None."""
    if superlink is None:
        if certificates is not None or insecure:
            raise UserError("--root-certificates and --insecure need --superlink.")
        return None
    if (certificates is None) == (not insecure):
        raise UserError("--superlink needs --root-certificates CA (TLS) or --insecure.")

    def connect(config: Any, membership: Any, fingerprint: str) -> Any:
        from dataclasses import replace

        from fedaudit.engine.deployment import SiteSignals

        flower = replace(config.flower, superlink=superlink, root_certificates=certificates, insecure=insecure)
        return SiteSignals(replace(config, engine="flower", flower=flower), membership, fingerprint)

    return connect


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the checks' own random choices (recorded in verification.json).",
)
@click.option(
    "--public-key",
    type=click.Path(dir_okay=False),
    help="PEM Ed25519 public key: the run must carry a signature.json made with its private key ('fedaudit sign') "
    "and still hold what was signed.",
)
@click.option(
    "--probe",
    is_flag=True,
    help="Also probe the DP query as this fedaudit's training makes it with the run's settings: neighbouring "
    "batches (one record added: real, huge, blank, mislabelled, or a gradient in each tensor and layer) whose "
    "released sums must differ by the record's gradient clipped to C and by at most C (docs/audit.md). Works on "
    "any record-level DP run, with or without canaries; about 5-15 s.",
)
@user_errors
def verify(run_dirs: tuple[str, ...], seed: int, public_key: str | None, probe: bool) -> None:
    """Check runs: their files, their signature, and that a DP canary run's mechanism does what it charges for.

    Files and ledger against the manifest's SHA-256 hashes, the signature (--public-key), and the recorded DP queries;
    writes RUN_DIR/verification.json.

    Independent recomputations of noise, clipping, sampling and the ledger (Google's dp-accounting), each a test at
    a family-wise level of 0.001: exit code 1 when a check fails. With --probe, the sensitivity probe too (an exact
    check). What each check computes: docs/audit.md.
    """
    from fedaudit import api
    from fedaudit.rundir.integrity import public_key_bytes

    key = None if public_key is None else public_key_bytes(_read_key(public_key), public_key)
    failed = False
    for outcome in api.verify(run_dirs, seed=seed, public_key=key, probe=probe):
        click.echo(f"{outcome.path}: {'PASS' if outcome.passed else 'FAIL'}")
        for problem in outcome.integrity:
            click.echo(f"  FAIL integrity: {problem}.")
        if not outcome.integrity:
            click.echo("  PASS integrity: every file matches its SHA-256 in manifest.json; the ledger recomputes.")
        if outcome.signature is not None:
            for problem in outcome.signature:
                click.echo(f"  FAIL signature: {problem}.")
            if not outcome.signature:
                click.echo("  PASS signature: signed with the given key; every signed file is unchanged.")
            if outcome.unsigned:
                click.echo(f"  not signed (written after signing): {', '.join(outcome.unsigned)}")
        if outcome.skipped:
            click.echo(f"  conformance not checked: {outcome.skipped}.")
        for check in outcome.verification.checks if outcome.verification is not None else ():
            p_value = "" if check.p_value is None else f" (p = {check.p_value:.3g}, n = {check.n})"
            if check.details.get("not_checked"):
                click.echo(f"  NOT CHECKED {check.name}: {check.sentence.removeprefix('Not checked: ')}")
                continue
            click.echo(f"  {'PASS' if check.passed else 'FAIL'} {check.name}{p_value}: {check.sentence}")
        failed = failed or not outcome.passed
    if failed:
        sys.exit(1)


MAX_KEY_BYTES = 64 << 10  # a PEM Ed25519 key is about 120 bytes


def _read_key(path: str) -> bytes:
    """A key file's bytes, at most :data:`MAX_KEY_BYTES` read (``/dev/zero`` is one sentence, not all of memory); an
    unreadable or larger one is one sentence."""
    from fedaudit.config import read_small_bytes

    try:
        return read_small_bytes(path, "key file", MAX_KEY_BYTES)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--key",
    required=True,
    type=click.Path(dir_okay=False),
    help="PEM Ed25519 private key (unencrypted), e.g. from 'openssl genpkey -algorithm ed25519 -out key.pem'.",
)
@user_errors
def sign(run_dirs: tuple[str, ...], key: str) -> None:
    """Sign runs with an Ed25519 key, so that an auditor can tell who produced them.

    RUN_DIR/signature.json holds the signature over the manifest (every file's SHA-256); 'fedaudit verify
    --public-key' checks it. A run whose files do not check is refused. See docs/run-directory.md (tamper evidence).
    """
    from fedaudit.rundir import RunDirectory

    pem = _read_key(key)
    for path in run_dirs:
        run = RunDirectory(path)
        run.read_manifest()
        with run.lock("fedaudit sign"):
            run.seal.sign(pem, key)
        click.echo(f"Signed {run.signature_path}")


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="The new directory the copy is written to.")
@user_errors
def export(run_dir: str, out: str) -> None:
    """Copy a run for someone else (an auditor, a server), without its clients' secrets.

    The copy holds every file the manifest hashes, the manifest and its signature, so it can be attacked, verified
    and reported; it leaves out client-secrets.json, whose holder could remove the clients' noise, so it cannot be
    resumed, and of a client-level DP run what only its server may see (each round's sample, the un-noised
    statistics of the updates, what the clients sent, the clients' states), listed in the copy's export.json. A run
    whose files do not check is refused. See docs/run-directory.md.
    """
    from fedaudit.rundir import RunDirectory

    run = RunDirectory(run_dir)
    run.read_manifest()
    with run.lock("fedaudit export", shared=True):
        count = run.seal.export(out)
    from fedaudit.rundir.private import left_out

    secret = [path.name for path in (run.secrets_path, run.server_secret_path) if path.exists()]
    private = len(left_out(Path(out)))
    if private:
        secret.append(f"{private} file(s) only the server may see (listed in the copy's export.json)")
    left = f"; left out: {', '.join(secret)}" if secret else ""
    click.echo(f"Exported {run.path} to {out}: {count} files{left}.")


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--out",
    required=True,
    type=click.Path(),
    help="Report file (.html, .md or .pdf) or a folder that receives report.<format>; summary.csv and "
    "summary.json go beside it.",
)
@click.option(
    "--format",
    "formats",
    multiple=True,
    metavar="FORMAT",
    help="html, md or pdf; repeat for several. [default: the suffix of --out, else html]",
)
@click.option(
    "--policy",
    "policy_file",
    type=click.Path(),
    help="YAML limits (max_epsilon with delta, max_attack_auc, max_tpr_at_0_1pct_fpr, max_tpr_at_1pct_fpr_per_client, "
    "min_accuracy, max_audit_ratio, max_failed_conformance_checks, max_reconstruction_psnr); exit code "
    "1 when a run fails one, 3 when the sample cannot decide one (INCONCLUSIVE).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing report (and its summaries) at --out.")
@user_errors
def report(
    run_dirs: tuple[str, ...], out: str, formats: tuple[str, ...], policy_file: str | None, overwrite: bool
) -> None:
    """Privacy report of runs: setup, utility, epsilon ledger, attack ROC/AUC and a policy verdict.

    HTML, Markdown or PDF; the sections and how policies are judged: docs/report.md; what each number means:
    docs/audit.md.
    """
    from fedaudit import api

    _finish_report(api.report(run_dirs, out, formats=formats, policy=policy_file, overwrite=overwrite))


def _finish_report(outcome: Any) -> None:
    """Say what a report wrote and its policy verdict; the exit code gates a pipeline: 0 PASS, 1 FAIL,
    3 INCONCLUSIVE (the sample cannot resolve some limit)."""
    from fedaudit.reports.policy import EXIT_CODES, PASS

    for path in outcome.written:
        click.echo(f"Wrote {path}")
    for run, why in outcome.broken.items():
        click.echo(f"{run}: FAIL: {why}.")
    if outcome.verdict is None and outcome.broken:
        sys.exit(1)
    if outcome.verdict is not None:
        open_checks = [
            f"{c.run}: {c.limit} {c.verdict}" for checks in outcome.checks.values() for c in checks if c.verdict != PASS
        ]
        click.echo(f"Policy: {outcome.verdict}" + (f" ({'; '.join(open_checks)})" if open_checks else ""))
        if outcome.broken or EXIT_CODES[outcome.verdict]:
            sys.exit(1 if outcome.broken else EXIT_CODES[outcome.verdict])


# Options of `train` that `compare` also takes, to set the base configuration of every run in a study.
COMPARE_BASE_OPTIONS = (
    "canaries",
    "canary_kind",
    "kept_queries",
    "dataset",
    "data_dir",
    "label_column",
    "image_size",
    "site_data",
    "partition",
    "num_clients",
    "holdout_fraction",
    "model",
    "width",
    "depth",
    "rounds",
    "client_fraction",
    "local_epochs",
    "lr",
    "batch_size",
    "max_grad_norm",
    "delta",
    "accountant",
    "device",
    "engine",
    "parallel_clients",
)


@main.command()
@click.option(
    "--study",
    "study_file",
    type=click.Path(dir_okay=False),
    help="YAML study file (algorithms, budgets, seeds, equal_data_access, base, attack, report); options given "
    "here override it.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(),
    help="Study directory: study.json, runs/<name>/ and the comparison report.",
)
@study_options
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="Base run configuration (YAML or JSON, as for train --config) instead of the study file's base.",
)
@click.option(
    "--signal",
    "signals",
    multiple=True,
    metavar="NAME",
    help=f"Attack signals, as for attack --signal. [default: {_shown(AttackOptions, 'signals')}]",
)
@click.option(
    "--method",
    "methods",
    multiple=True,
    metavar="NAME",
    help=f"Attack methods, as for attack --method. [default: {_shown(AttackOptions, 'methods')}]",
)
@click.option("--target", help=f"Attacked models, as for attack --target. [default: {_shown(AttackOptions, 'target')}]")
@click.option(
    "--attack",
    "audits",
    multiple=True,
    type=click.Choice(["reconstruction"]),
    help="An audit beside the membership attacks: reconstruction (rebuild each client's records from what it sent, "
    "as for attack --method reconstruction; the runs keep what crossed the wire).",
)
@click.option(
    "--overwrite", is_flag=True, help="Retrain runs whose stored configuration differs from the study's plan."
)
@click.option(
    "--progress/--no-progress", default=None, help="Show progress over the whole study. [default: only on a terminal]"
)
@click.option(
    "--yes",
    is_flag=True,
    help="Start even when the plan's estimated time passes 10 minutes (without it such a study is refused before "
    "anything is written; in CI it always starts).",
)
@user_errors
def compare(
    study_file: str | None,
    out: str,
    algorithms: tuple[str, ...],
    budgets: tuple[str, ...],
    seeds: tuple[int, ...],
    equal_data_access: bool | None,
    max_update_norm: float | None,
    config_file: str | None,
    signals: tuple[str, ...],
    methods: tuple[str, ...],
    target: str | None,
    audits: tuple[str, ...],
    formats: tuple[str, ...],
    policy: str | None,
    overwrite: bool,
    progress: bool | None,
    yes: bool,
    **base: Any,
) -> None:
    """Run a whole study (algorithms x budgets x seeds): train, attack and report each, then one comparison report.

    It first prints its plan and an estimate of its time here (one first round of each algorithm is timed); a study
    estimated to take more than 10 minutes starts only with --yes. Running it again does only what is missing:
    finished runs and attacks are kept, interrupted runs resume. The study directory's layout:
    docs/run-directory.md; equal data access: docs/algorithms.md; study files and examples: docs/compare.md.
    """
    from fedaudit import api
    from fedaudit.study import study_from_options

    study = study_from_options(
        study_file,
        algorithms=algorithms,
        budgets=budgets,
        seeds=seeds,
        equal_data_access=equal_data_access,
        max_update_norm=max_update_norm,
        config_file=config_file,
        # a repeated option not given is (): the study file's value stands, as for None
        base_overrides={option_field(name): value if value != () else None for name, value in base.items()},
        attack_overrides={"signals": signals, "methods": methods, "target": target},
        formats=formats,
        policy=policy,
        audits=audits,
    )
    _finish_report(api.compare(study, out, overwrite=overwrite, progress=show_progress(progress), yes=yes))


compare.params.extend(param for param in train.params if param.name in COMPARE_BASE_OPTIONS)


@main.command()
@click.argument("own", nargs=-1, metavar="[npz:PATH | csv:PATH | folder:DIR]...")
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False),
    help="Look in this directory instead of $FEDAUDIT_DATA_DIR and /usr/share/datasets, as train's --data-dir does.",
)
@click.option("--label-column", help="csv:PATH: the column holding each record's class.")
@click.option(
    "--image-size",
    type=int,
    help=f"folder:DIR: square size images are resized to. [default: {_shown(DataConfig, 'image_size')}]",
)
@user_errors
def datasets(own: tuple[str, ...], data_dir: str | None, label_column: str | None, image_size: int | None) -> None:
    """List the datasets fedaudit reads, where each was found, and its size.

    With your own data (npz:, csv:, folder:), read it as train would and show its sizes, shape, classes and
    fingerprint: docs/your-data.md.
    """
    from fedaudit.data import dataset_table, dataset_text
    from fedaudit.data.registry import user_dataset_row

    table = dataset_table(data_dir)
    if own:
        import pandas as pd

        rows = [user_dataset_row(name, label_column=label_column, image_size=image_size) for name in own]
        table = pd.concat([table, pd.DataFrame(rows)], ignore_index=True).astype({"train": "Int64", "test": "Int64"})
    click.echo(dataset_text(table))


for _command in main.commands.values():
    # `fedaudit --help` lists each command with its whole first sentence, wrapped, instead of click's 45-character cut.
    _command.short_help = (_command.help or "").split("\n\n")[0].replace("\n", " ").strip()


if __name__ == "__main__":
    main()

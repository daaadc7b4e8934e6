"""The ``fedaudit`` command line: parse, validate, call the packages.

Errors a user can cause end with one sentence on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from fedaudit.algorithms.fedgm_settings import DISTILL_INITS, LABEL_MECHANISMS
from fedaudit.algorithms.fedlap_settings import FEDLAP_INITS, RADIUS_STRATEGIES
from fedaudit.algorithms.fedssyn_settings import FEDSSYN_INNER
from fedaudit.config import CANARY_KINDS, DEVICES, ENGINES, LR_SCHEDULES, WEIGHTINGS, option_field
from fedaudit.errors import USER_ERROR_EXIT, UserError
from fedaudit.registry import ACCOUNTANTS, ALGORITHMS, DEFAULT_ACCOUNTANT, DEFAULT_ALGORITHM


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


def per_algorithm(setting: str, dataset: str = "digits") -> str:
    """The registry's default ``setting`` (client_lr or max_grad_norm) of each algorithm in words, with the dataset's
    overrides: "0.1 fedavg/fedsgd, 0.2 fedprox, 1 fedlap; 1 on digits (fedavg/fedprox/fedsgd)"."""
    by_value: dict[float, list[str]] = {}
    for entry in ALGORITHMS.values():
        by_value.setdefault(getattr(entry, setting), []).append(entry.name)
    text = ", ".join(f"{value:g} {'/'.join(names)}" for value, names in by_value.items())
    on_dataset: dict[float, list[str]] = {}
    for entry in ALGORITHMS.values():
        value = getattr(entry, f"default_{setting}")(dataset)
        if value != getattr(entry, setting):
            on_dataset.setdefault(value, []).append(entry.name)
    overrides = ", ".join(f"{value:g} on {dataset} ({'/'.join(names)})" for value, names in on_dataset.items())
    return f"{text}; {overrides}" if overrides else text


ALGORITHM_HELP = "Federated algorithm: " + "; ".join(f"{e.name} ({e.label}: {e.summary})" for e in ALGORITHMS.values())
ACCOUNTANT_HELP = "Privacy accountant: " + "; ".join(f"{e.name} ({e.summary})" for e in ACCOUNTANTS.values())


@click.group(cls=OneSentenceGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="fedaudit")
def main() -> None:
    """fedaudit: train federated models with record-level DP and audit how much they leak.

    The flow is train, then attack, then report (or compare for a whole study). The algorithms, the accountant,
    the audit and the run directory are described in docs/ (algorithms.md, accounting.md, audit.md,
    run-directory.md).
    """


@main.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="YAML or JSON file with the configuration (sections data, model, federated, privacy); options given "
    "here override it.",
)
@click.option(
    "--algorithm",
    type=click.Choice(list(ALGORITHMS)),
    help=f"{ALGORITHM_HELP}. [default: {DEFAULT_ALGORITHM}]",
)
@click.option(
    "--dp/--no-dp",
    default=None,
    help="Record-level DP: DP-SGD on every client step (DP-FedAvg, DP-FedProx). [default: off]",
)
@click.option(
    "--noise-multiplier",
    type=float,
    help="sigma: Gaussian noise std relative to the clipping norm. [default with --dp: 1.0]",
)
@click.option(
    "--max-grad-norm",
    type=float,
    help=f"C: per-sample gradient clipping norm. [default: {per_algorithm('max_grad_norm')}]",
)
@click.option(
    "--target-epsilon", type=float, help="Calibrate sigma so that epsilon after the last round is at most this."
)
@click.option("--delta", type=float, help="delta of (epsilon, delta)-DP. [default: 1e-5]")
@click.option(
    "--accountant", type=click.Choice(list(ACCOUNTANTS)), help=f"{ACCOUNTANT_HELP}. [default: {DEFAULT_ACCOUNTANT}]"
)
@click.option(
    "--noise-seed",
    type=int,
    help="Draw every client's DP noise and Poisson samples from this public seed, reproducibly, instead of from a "
    "secret that only the client holds: for experiments only, since whoever holds the seed can remove the noise "
    "(the report says so). [default: each client's own secret]",
)
@click.option(
    "--secure-noise/--no-secure-noise",
    default=None,
    help="DP queries draw from a ChaCha20 keystream, each Gaussian coordinate the sum of four float64 draws, "
    "against floating-point attacks on the noise (docs/accounting.md; slower). [default: off]",
)
@click.option(
    "--dataset",
    help="digits, mnist, fashion-mnist, cifar10, or your own data: npz:PATH (arrays x, y [, x_test, y_test]), "
    "csv:PATH (with --label-column) or folder:DIR (a sub-folder of images per class); sites: every client's "
    "records are its own site's (--site-data). [default: digits]",
)
@click.option("--label-column", help="--dataset csv:PATH: the column holding each record's class.")
@click.option("--image-size", type=int, help="--dataset folder:DIR: square size images are resized to. [default: 32]")
@click.option(
    "--site-data",
    multiple=True,
    help="--dataset sites (a federation whose sites keep their records), local engine: one client's own data, "
    "npz:PATH, csv:PATH or folder:DIR, once per client in client order (docs/your-data.md). In a Flower deployment "
    "each site names its own in its node config instead.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False),
    help="Directory holding the dataset files (torchvision root layout or flat).",
)
@click.option(
    "--download/--no-download", default=None, help="Allow torchvision to download the dataset into --data-dir."
)
@click.option("--partition", help="iid, classes:K or dirichlet:ALPHA. [default: classes:2]")
@click.option("--num-clients", type=int, help="Number of clients K. [default: 5]")
@click.option(
    "--holdout-fraction",
    type=float,
    help="Fraction of the training split held out as non-members for auditing. [default: 0.1]",
)
@click.option(
    "--model",
    help="convnet, mlp, or your own: package.module:factory, called with (input_shape, num_classes) and returning "
    "a torch.nn.Module (importable here and where the run is attacked). [default: convnet]",
)
@click.option("--width", type=int, help="Channels (ConvNet) or hidden units (MLP). [default: 128; 32 on digits]")
@click.option(
    "--depth",
    type=int,
    help="Blocks (ConvNet) or hidden layers (MLP). [default: fitted to the input size: 3 for 32x32 images]",
)
@click.option("--rounds", type=int, help="Communication rounds M. [default: 10]")
@click.option("--client-fraction", type=float, help="Fraction p of clients selected per round. [default: 1.0]")
@click.option(
    "--weighting",
    type=click.Choice(WEIGHTINGS),
    help="Aggregation weights N_k/N or 1/K. [default: num_examples]",
)
@click.option("--server-lr", type=float, help="Server learning rate eta_s. [default: 1.0]")
@click.option("--local-epochs", type=int, help="Local epochs E. [default: 5]")
@click.option("--lr", type=float, help=f"Client learning rate eta_c. [default: {per_algorithm('client_lr')}]")
@click.option("--momentum", type=float, help="Client SGD momentum. [default: 0]")
@click.option(
    "--batch-size",
    type=int,
    help="(Expected) batch size B; under DP the Poisson rate is B / N_k. [default: 256; 32 on digits]",
)
@click.option("--mu", type=float, help="FedProx proximal weight. [default: 0.1]")
@click.option(
    "--lr-schedule",
    type=click.Choice(LR_SCHEDULES),
    help="Client learning rate over rounds. [default: cosine]",
)
@click.option(
    "--local-steps", type=int, help="Local steps per round instead of --local-epochs (DP queries per round under DP)."
)
@click.option("--ipc", type=int, help="FedLAP: synthetic images per class. [default: 10 with --dp, 50 without]")
@click.option(
    "--trajectories",
    type=int,
    help="FedLAP R_i: trajectories, each reset to the global model. [default: 4 / 1; 1 on digits with --dp]",
)
@click.option("--max-loops", type=int, help="FedLAP L: loop cap per trajectory. [default: 5]")
@click.option(
    "--real-batches", type=int, help="FedLAP R_b: real batches per loop. [default: 10 / 40; 2 on digits with --dp]"
)
@click.option("--image-steps", type=int, help="FedLAP J: image updates per real gradient. [default: 5]")
@click.option(
    "--model-epochs", type=int, help="FedLAP R_l: model epochs on the synthetic set between loops. [default: 2 / 0]"
)
@click.option("--radius", type=float, help="FedLAP r: trust-region radius. [default: 1.5 / 10; 5 on digits with --dp]")
@click.option("--image-lr", type=float, help="FedLAP tau: image learning rate (SGD, momentum 0.5). [default: 100]")
@click.option(
    "--mse-weight",
    type=float,
    help="FedLAP lambda: weight of the squared error in the matching loss. [default: 0 / 0.1]",
)
@click.option(
    "--init",
    type=click.Choice(FEDLAP_INITS),
    help="FedLAP synthetic set initialisation (real: non-DP only). [default: noise / real]",
)
@click.option(
    "--augment/--no-augment",
    default=None,
    help="FedLAP: differentiable augmentation of real and synthetic batches. [default: off]",
)
@click.option("--server-batch-size", type=int, help="FedLAP server minibatch. [default: 512]")
@click.option("--server-epochs", type=int, help="FedLAP and FedDM: server epochs at most. [default: 100]")
@click.option(
    "--radius-strategy",
    type=click.Choice(RADIUS_STRATEGIES),
    help="FedLAP server radius r_g from the clients' r_k. [default: min]",
)
@click.option("--dm-ipc", type=int, help="FedDM: synthetic images per class a client holds. [default: 10]")
@click.option("--dm-iterations", type=int, help="FedDM: image steps, each on a newly sampled network. [default: 100]")
@click.option("--dm-lr", type=float, help="FedDM: synthetic image learning rate (SGD). [default: 1]")
@click.option("--dm-batch", type=int, help="FedDM: real images per class in one step. [default: 256]")
@click.option(
    "--dm-radius",
    type=float,
    help="FedDM rho: networks are sampled at this distance from the global model, and the server trains within "
    "it. [default: 5]",
)
@click.option("--distill-ipc", type=int, help="FedGM: synthetic images per class a client holds. [default: 10]")
@click.option(
    "--distill-iterations",
    type=int,
    help="FedGM: freshly initialised networks the gradient matching runs on. [default: 20]",
)
@click.option("--distill-steps", type=int, help="FedGM: matching steps per network. [default: 10]")
@click.option("--distill-lr", type=float, help="FedGM: synthetic image learning rate (SGD). [default: 0.1]")
@click.option("--distill-batch", type=int, help="FedGM: real images per class in a matching step. [default: 128]")
@click.option(
    "--distill-init",
    type=click.Choice(DISTILL_INITS),
    help="FedGM: start the synthetic images from real images of the class or from noise. [default: real]",
)
@click.option(
    "--label-epsilon",
    type=float,
    help="FedGM: label DP of every label sent (epsilon of the label mechanism; images are sent in clear). "
    "[default: none, labels in clear]",
)
@click.option(
    "--label-mechanism",
    type=click.Choice(LABEL_MECHANISMS),
    help="FedGM: randomized response, RR over the prior's top k, or RR with the best k for the prior (the "
    "server's model of the earlier stages). [default: rr-with-prior]",
)
@click.option("--top-k", type=int, help="FedGM: k of --label-mechanism rr-top-k.")
@click.option(
    "--server-steps", type=int, help="FedGM: server SGD steps on the union of what it received. [default: 500]"
)
@click.option(
    "--inner-algorithm",
    type=click.Choice(FEDSSYN_INNER),
    help="Fedssyn: the federated algorithm that trains on real plus shuffled synthetic records after the "
    "generation round. [default: fedavg]",
)
@click.option(
    "--generator-fraction",
    type=float,
    help="Fedssyn rho: the share of a client's records its generator trains on. [default: 0.75]",
)
@click.option(
    "--synthetic-per-client",
    type=int,
    help="Fedssyn n~: records each client generates, and the size of every client's shuffled share. "
    "[default: the mean client's records]",
)
@click.option("--generator-epochs", type=int, help="Fedssyn: epochs of the generator's training. [default: 30]")
@click.option(
    "--generator-batch", type=int, help="Fedssyn: generator minibatch (expected batch under DP). [default: 64]"
)
@click.option("--generator-lr", type=float, help="Fedssyn: generator learning rate (Adam). [default: 0.001]")
@click.option(
    "--generator-clip", type=float, help="Fedssyn with --dp: clipping norm of the generator's DP-SGD. [default: 1]"
)
@click.option(
    "--canaries",
    type=int,
    help="Plant this many canaries for a canary audit (`fedaudit attack --method canary`): each included "
    "with probability 1/2 in one client's data, sampled, clipped and noised like its records. Needs --dp. "
    "[default: 0]",
)
@click.option(
    "--canary-kind",
    type=click.Choice(CANARY_KINDS),
    help="gradient: a random direction whose per-example gradient is 10 C times itself (clipped to C), audited on "
    "what every client sent (the server's white-box view). input: a held-out record with another class's label, "
    "audited on what clients sent and by its loss on the final model (black-box). Both keep what clients send. "
    "[default: gradient]",
)
@click.option(
    "--kept-queries",
    type=int,
    help="Whole DP queries (parameters, batch, released sum) a canary run's query log keeps, on average, in pairs "
    "of consecutive queries, so that `fedaudit verify` can recompute their clean sums (more: more power against "
    "clipping faults, a larger run directory and a slower verify; 0: none). [default: 12]",
)
@click.option(
    "--save-transmitted/--no-save-transmitted",
    default=None,
    help="Store what every client sent each round under transmitted/.",
)
@click.option(
    "--keep-checkpoints",
    type=int,
    help="Keep only the last N rounds' checkpoints (resume stays exact from the last). [default: every round's]",
)
@click.option(
    "--eval-every",
    type=int,
    help="Measure the test accuracy every K rounds and after the last (a long federation spends most of its time "
    "evaluating otherwise). [default: 1]",
)
@click.option(
    "--eval-sample",
    type=int,
    help="Measure it on a fixed random sample of N test records, drawn from the seed (its interval is over N). "
    "[default: the whole test split]",
)
@click.option(
    "--equal-data-access",
    is_flag=True,
    help="Print the DP-FedAvg settings with the same DP queries per round as this configuration, and exit.",
)
@click.option(
    "--seed",
    type=int,
    help="Seed of the run's public random choices (split, initial model, client selection); a DP run's noise and "
    "samples come from each client's own secret (see --noise-seed). [default: 0]",
)
@click.option("--device", type=click.Choice(DEVICES), help="Where to train. [default: auto]")
@click.option(
    "--engine",
    type=click.Choice(ENGINES),
    help="Who runs the clients: in this process, or Flower's simulation runtime (Ray; needs the flower extra); "
    "the same seed and client secrets give the same run on both. [default: local]",
)
@click.option(
    "--ray-address",
    help="HOST:PORT of an existing Ray cluster's head for --engine flower's simulation runtime (docs/deployment.md). "
    "[default: a Ray instance on this machine]",
)
@click.option("--client-cpus", type=float, help="CPUs each simulated client reserves on Ray. [default: 1]")
@click.option(
    "--client-gpus",
    type=float,
    help="Share of a GPU each simulated client reserves on Ray. [default: 1/clients on CUDA, else 0]",
)
@click.option(
    "--superlink",
    help="HOST:PORT of a Flower SuperLink: with --engine flower, the clients run on the SuperNodes of that "
    "deployment, one per site (docs/deployment.md), instead of Flower's simulation runtime.",
)
@click.option(
    "--root-certificates",
    type=click.Path(dir_okay=False),
    help="The CA certificate (PEM) that signed the SuperLink's TLS certificate.",
)
@click.option("--insecure", is_flag=True, default=None, help="Talk to the SuperLink without TLS (only when asked).")
@click.option(
    "--wait-seconds",
    type=float,
    help="How long to wait for every client's SuperNode to connect. [default: 300]",
)
@click.option(
    "--round-timeout",
    type=float,
    help="How long a round may wait for a site that neither answers nor dies. [default: 3600]",
)
@click.option(
    "--parallel-clients",
    type=int,
    help="How many clients the local engine runs at once (threads, each with its own CUDA stream on a GPU), or how "
    "many sites of a Flower deployment are sent work at once (sites that share machines); the results do not "
    "depend on it. [default: local: all of a round's clients on CUDA, 1 on CPU; deployment: all]",
)
@click.option("--out", type=click.Path(), help="Run directory to create.")
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(),
    help="Continue the interrupted run in this directory (only --rounds may change).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing run at --out.")
@click.option("--progress/--no-progress", default=None, help="Show progress bars. [default: only on a terminal]")
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
    from fedaudit.setup import TrainingError, data_access

    progress = show_progress(progress)
    given = {name for name in options if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}
    options["site_data"] = options.get("site_data") or None  # not given: the configuration file's, if any
    if resume_dir is not None:
        extra = (
            sorted(given - {"rounds", "device", *RESUME_SETTINGS})
            + (["config"] if config_file else [])
            + (["out"] if out else [])
            + (["overwrite"] if overwrite else [])
        )
        if extra:
            raise TrainingError(
                "--resume continues a run with its stored configuration; only --rounds, --device and the "
                "settings of where clients run (--parallel-clients, --ray-address, --client-cpus, --client-gpus, "
                "--superlink, --root-certificates, --insecure, --wait-seconds, --round-timeout) may be given with "
                f"it, not --{extra[0].replace('_', '-')}."
            )
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
            f"{privacy.target_epsilon:g} over the rounds each client takes part in."
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
@click.option(
    "--signal",
    "signals",
    multiple=True,
    metavar="NAME",
    help="loss, grad-norm, confidence or logit-confidence; synthetic-distance (distance to the nearest synthetic "
    "image that crossed the wire: FedLAP and FedGM runs kept with --save-transmitted); repeat for several. "
    "[default: loss and grad-norm]",
)
@click.option(
    "--method",
    "methods",
    multiple=True,
    metavar="NAME",
    help="threshold, classifier, population, rmia or lira (with reference models), canary (the run's canaries), or "
    "reconstruction (rebuild a client's records from what it sent: runs kept with --save-transmitted); repeat for "
    "several. [default: threshold and classifier]",
)
@click.option(
    "--references",
    type=int,
    default=4,
    show_default=True,
    help="rmia and lira: reference models, each the run's recipe retrained on population records (cached in "
    "RUN_DIR/references/).",
)
@click.option(
    "--online",
    is_flag=True,
    help="rmia and lira: the audited records join the references' pool, each in half of them (K even; the "
    "references are then specific to these records).",
)
@click.option(
    "--target",
    help="final (model.safetensors), round:N (its checkpoint) or all (every saved round); for reconstruction, what "
    "the clients sent in those rounds, or round:N:client:K one client's. [default: final; reconstruction: every "
    "client of the first and the final round]",
)
@click.option(
    "--iterations",
    type=int,
    default=250,
    show_default=True,
    help="reconstruction: optimisation steps of each random start.",
)
@click.option(
    "--restarts", type=int, default=4, show_default=True, help="reconstruction: random starts (the best is kept)."
)
@click.option(
    "--psnr-threshold",
    type=float,
    default=20.0,
    show_default=True,
    help="reconstruction: a record counts as recovered at this PSNR (dB) or more.",
)
@click.option(
    "--nonmembers",
    default="both",
    show_default=True,
    help="Non-members from the held-out pool (holdout), the test split (test) or both.",
)
@click.option(
    "--max-records",
    type=int,
    default=2000,
    show_default=True,
    help="At most this many members and as many non-members.",
)
@click.option(
    "--per-layer", is_flag=True, help="With grad-norm: also write each layer's gradient norm into scores.csv."
)
@click.option(
    "--batch-size",
    type=int,
    default=64,
    show_default=True,
    help="Records per batch when computing signals (more use more memory: the width-128 ConvNet's gradient-norm "
    "signal holds about 2.3 MB per record).",
)
@click.option(
    "--bootstrap",
    "resamples",
    type=int,
    default=1000,
    show_default=True,
    help="Bootstrap resamples of the AUC interval.",
)
@click.option(
    "--seed",
    type=int,
    help="Seed of the evaluation set, the split and the attack classifier. [default: the run's seed]",
)
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="Where to compute the signals.",
)
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
    from fedaudit.integrity import public_key_bytes

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
    resumed. A run whose files do not check is refused. See docs/run-directory.md.
    """
    from fedaudit.rundir import RunDirectory

    run = RunDirectory(run_dir)
    run.read_manifest()
    with run.lock("fedaudit export", shared=True):
        count = run.seal.export(out)
    left = " (client-secrets.json left out)" if run.secrets_path.exists() else ""
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


# Options of `train --resume` that change how a run is carried out, never its results.
RESUME_SETTINGS = (
    "parallel_clients",
    "ray_address",
    "client_cpus",
    "client_gpus",
    "superlink",
    "root_certificates",
    "insecure",
    "wait_seconds",
    "round_timeout",
)

# Options of `train` that `compare` also takes, to set the base configuration of every run in a study.
COMPARE_BASE_OPTIONS = (
    "canaries",
    "canary_kind",
    "kept_queries",
    "dataset",
    "data_dir",
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
@click.option(
    "--algorithm",
    "algorithms",
    multiple=True,
    type=click.Choice(list(ALGORITHMS)),
    help="Repeat for several. [default: fedavg, fedprox, fedlap]",
)
@click.option(
    "--budget",
    "budgets",
    multiple=True,
    metavar="SPEC",
    help="epsilon:E (sigma calibrated so that epsilon after the last round is at most E; eps:E is the same), "
    "sigma:S (noise:S is the same), or none (no DP; also no-dp); repeat for several. [default: sigma:1]",
)
@click.option(
    "--seed",
    "seeds",
    multiple=True,
    type=int,
    help="Repeat for several; the report gives mean and spread over seeds. [default: 0]",
)
@click.option(
    "--equal-data-access/--no-equal-data-access",
    default=None,
    help="FedAvg/FedProx make as many DP queries per round as FedLAP's worst case (the paper's fair "
    "comparison). [default: off]",
)
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
    help="Attack signals, as for attack --signal. [default: loss and grad-norm]",
)
@click.option(
    "--method",
    "methods",
    multiple=True,
    metavar="NAME",
    help="Attack methods, as for attack --method. [default: threshold and classifier]",
)
@click.option("--target", help="Attacked models, as for attack --target. [default: final]")
@click.option(
    "--attack",
    "audits",
    multiple=True,
    type=click.Choice(["reconstruction"]),
    help="An audit beside the membership attacks: reconstruction (rebuild each client's records from what it sent, "
    "as for attack --method reconstruction; the runs keep what crossed the wire).",
)
@click.option(
    "--format", "formats", multiple=True, metavar="FORMAT", help="html, md or pdf; repeat for several. [default: html]"
)
@click.option(
    "--policy",
    type=click.Path(dir_okay=False),
    help="YAML limits checked on every run, as for report --policy; exit code 1 when a run fails one, 3 when "
    "one is INCONCLUSIVE.",
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
        config_file=config_file,
        base_overrides={option_field(name): value for name, value in base.items()},
        attack_overrides={"signals": signals, "methods": methods, "target": target},
        formats=formats,
        policy=policy,
        audits=audits,
    )
    _finish_report(api.compare(study, out, overwrite=overwrite, progress=show_progress(progress), yes=yes))


compare.params.extend(param for param in train.params if param.name in COMPARE_BASE_OPTIONS)


@main.command()
@click.argument("own", nargs=-1, metavar="[npz:PATH | csv:PATH | folder:DIR]...")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Also look in this directory.")
@click.option("--label-column", help="csv:PATH: the column holding each record's class.")
@click.option("--image-size", type=int, help="folder:DIR: square size images are resized to. [default: 32]")
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

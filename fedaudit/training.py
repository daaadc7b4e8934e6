"""The shared training core: set up a run, run its rounds, checkpoint, account, resume.

Every algorithm goes through :func:`train` / :func:`resume`: data and
partition, model initialisation, client selection, the engine that runs the
clients, the server update, evaluation, the privacy ledger and the run
directory are the same for all of them.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fedaudit.algorithms.base import (
    EVAL_BATCH,
    ClientData,
    ClientMessage,
    RoundContext,
    TensorDict,
    clone_params,
    evaluation_counts,
    privacy_plan,
    run_client,
)
from fedaudit.config import RunConfig, accountant_delta, option_field
from fedaudit.data.sites import is_sites
from fedaudit.engine import Engine, LocalEngine, make_engine
from fedaudit.instruments.canary_clients import RunCanaries
from fedaudit.instruments.canary_log import read_log
from fedaudit.models import build_model, initial_params, num_parameters
from fedaudit.preparation import Setup, TrainingError, client_data, prepare, round_participants
from fedaudit.privacy.accounting import PrivacyLedger, SGMEvent, compose, round_events
from fedaudit.privacy.layers import fallback_layers
from fedaudit.privacy.primitive import poisson_sample
from fedaudit.privacy.randomness import (
    CLIENT_SECRETS,
    SERVER_NOISE,
    SERVER_SALT,
    SERVER_SAMPLE,
    ClientKeys,
    RunRandomness,
    new_run_id,
)
from fedaudit.registry import ALGORITHMS, algorithm_label
from fedaudit.rundir import (
    EXPORT_RECORD,
    SALT,
    ClientsRecord,
    DatasetRecord,
    Manifest,
    ModelRecord,
    RandomnessRecord,
    RunDirectory,
    RunError,
    now_iso,
    private_columns,
    remove_stale_temporaries,
    versions,
)
from fedaudit.seeding import Stream, make_generator, numpy_rng, repeatable

Echo = Callable[[str], None]


@dataclass(frozen=True)
class TrainResult:
    """Where the run went and how it ended."""

    run_dir: Path
    rounds_done: int
    test_accuracy: float
    epsilon: float


def train(
    config: RunConfig, out: str | Path, *, overwrite: bool = False, progress: bool = True, echo: Echo = tqdm.write
) -> TrainResult:
    """Train a new run into ``out``; the configuration is checked completely before the directory is touched.

    Args:
        config: the run's configuration (defaults are resolved and written to config.json).
        out: the run directory to create.
        overwrite: replace an existing run at ``out`` (never a directory that is not a run).
        progress: show progress bars.
        echo: receives one line per round (accuracy, loss, epsilon, time, bytes sent).

    Returns:
        Where the run went, its rounds, final test accuracy and epsilon (infinite without DP).

    Raises:
        UserError: a configuration, data or run-directory problem, in one sentence; nothing is written.
    """
    return train_setup(prepare_run(config), out, overwrite=overwrite, progress=progress, echo=echo)


def prepare_run(config: RunConfig, *, device: str | None = None) -> Setup:
    """:func:`fedaudit.preparation.prepare`, after asking the sites of a deployment whose sites keep their records what
    they hold (no record leaves a site: counts, positions and hashes)."""
    if is_sites(config.data.dataset) and config.flower.superlink is not None and config.engine == "flower":
        from fedaudit.engine.deployment import survey_sites

        config.validate()
        return prepare(config, device=device, sites=survey_sites(config))
    return prepare(config, device=device)


def train_setup(
    setup: Setup, out: str | Path, *, overwrite: bool = False, progress: bool = True, echo: Echo = tqdm.write
) -> TrainResult:
    """Train a new run from an already prepared (validated, calibrated) :class:`Setup`."""
    _say_fallback_layers(setup, echo)
    run, locks = RunDirectory.start_new(out, overwrite)
    try:
        run.write_config(setup.config.to_dict())
        run.write_membership(setup.membership_arrays())
        if setup.canaries is not None:
            run.write_canaries(setup.canaries.to_arrays())
        state = _TrainingState(
            params=_initial_params(setup), ledger=_new_ledger(setup.config), states=ClientStates(run, setup.device)
        )
        randomness = RunRandomness.for_config(setup.config, new_run_id(), at_sites=_at_sites(setup.config))
        manifest = _manifest(setup, rounds_done=0, created=now_iso(), randomness=randomness)
        run.write_manifest(manifest)
        return _run_rounds(setup, run, manifest, state, randomness, progress=progress, echo=echo)
    finally:
        run.discard()  # a start that never committed a round leaves nothing
        for lock in reversed(locks):
            lock.release()


def _say_fallback_layers(setup: Setup, echo: Echo) -> None:
    """Once per run: which layers of a DP-SGD run's model the layer-wise query cannot compute in closed form."""
    if not setup.config.privacy.record_level:
        return
    slow = fallback_layers(build_model(setup.spec))
    if slow:
        echo(
            f"DP: per-example gradients of {', '.join(slow)} are computed one example at a time (vmap); Linear, Conv2d "
            "and GroupNorm layers get them in closed form, faster and in less memory."
        )


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


def refuse_resume_settings(given: Iterable[str]) -> None:
    """A resumed run keeps its stored configuration: anything but --rounds, --device and where its clients run is
    refused (a new learning rate or noise multiplier would make the run another one, and its ledger a lie)."""
    extra = sorted(set(given) - {"rounds", "device", *RESUME_SETTINGS})
    if extra:
        raise TrainingError(
            "--resume continues a run with its stored configuration; only --rounds, --device and the settings of "
            "where clients run (--parallel-clients, --ray-address, --client-cpus, --client-gpus, --superlink, "
            "--root-certificates, --insecure, --wait-seconds, --round-timeout) may be given with it, not "
            f"--{extra[0].replace('_', '-')}."
        )


def resume(
    run_dir: str | Path,
    *,
    rounds: int | None = None,
    device: str | None = None,
    settings: Mapping[str, Any] | None = None,
    progress: bool = True,
    echo: Echo = tqdm.write,
) -> TrainResult:
    """Continue an interrupted run from its last committed round, or extend a complete one to ``rounds``.

    The resumed run is byte-identical to an uninterrupted one: the partition is rebuilt from the seed and compared
    with membership.npz, the data must have the recorded fingerprint, and every random stream is derived from
    (seed, stream, round, client).

    Args:
        run_dir: the run directory.
        rounds: a new total number of rounds (not fewer than done; not more for a ``--target-epsilon`` run).
        device: where the rest of the run trains (the results do not depend on it).
        settings: configuration fields the results do not depend on either, by option name (``parallel_clients``
            and where Flower runs the clients: ``ray_address``, ``client_cpus``, ``client_gpus``, ``superlink``,
            ``root_certificates``, ``insecure``, ``wait_seconds``, ``round_timeout``); ``None`` values are ignored.
        progress: show progress bars.
        echo: receives one line per round.

    Returns:
        As :func:`train`.

    Raises:
        UserError: the directory is not a resumable run, or ``rounds`` cannot be honoured.
    """
    refuse_resume_settings(name for name, value in (settings or {}).items() if value is not None)
    run = RunDirectory(run_dir)
    run.read_manifest()  # a directory that is not a run is told so before it is locked
    with run.lock("fedaudit train --resume"):
        return _resume(run, rounds=rounds, device=device, settings=settings, progress=progress, echo=echo)


def _resume(
    run: RunDirectory,
    *,
    rounds: int | None,
    device: str | None,
    settings: Mapping[str, Any] | None,
    progress: bool,
    echo: Echo,
) -> TrainResult:
    remove_stale_temporaries(run.path)  # half-written files of the interrupted process
    if (run.path / EXPORT_RECORD).exists():
        raise TrainingError(
            f"{run.path} is a copy made for others by fedaudit export ({EXPORT_RECORD}): it holds neither the "
            "clients' secrets nor the server's records, so it cannot be resumed; resume the run it was copied from."
        )
    run.seal.check("resume")
    run.settle()
    manifest = run.read_manifest()
    config = run.read_run_config()
    done = manifest.rounds_done
    _refuse_new_rounds_for_a_round_in_flight(run, manifest, config, rounds, settings)
    if rounds is not None:
        if rounds < done:
            raise TrainingError(f"--rounds {rounds} is fewer than the {done} rounds {run.path} has already completed.")
        if config.privacy.dp and config.privacy.target_epsilon is not None and rounds > config.federated.rounds:
            raise TrainingError(
                f"{run.path} calibrated its noise for --target-epsilon {config.privacy.target_epsilon:g} over "
                f"{config.federated.rounds} rounds; more rounds would spend more than that budget, so start a new run."
            )
        if rounds > config.federated.rounds and config.federated.lr_schedule == "cosine":
            later = f"round {rounds} follows" if done + 1 == rounds else f"rounds {done + 1} to {rounds} follow"
            echo(
                f"Note: the cosine learning-rate schedule of {run.path} was laid over {config.federated.rounds} "
                f"rounds; {later} one over {rounds}, so the run will differ from one trained for {rounds} rounds "
                "from the start (--lr-schedule constant for runs you will extend)."
            )
        config = replace(config, federated=replace(config.federated, rounds=rounds))
    if settings:
        config = config.with_overrides({option_field(name): value for name, value in settings.items()})
        config.validate()
    setup = prepare_run(config, device=device)
    run.check_dataset(setup.dataset)
    stored = run.read_membership()
    rebuilt = setup.membership_arrays()
    if set(stored) != set(rebuilt) or any(not np.array_equal(stored[key], value) for key, value in rebuilt.items()):
        raise RunError(
            f"The partition rebuilt from the seed differs from {run.membership_path}; the run cannot be resumed."
        )
    run_id = manifest.randomness.run_id if manifest.randomness is not None else new_run_id()
    randomness = RunRandomness.resumed(
        setup.config, manifest.randomness_source, run_id, run.secrets_path, at_sites=_at_sites(setup.config)
    )
    run.write_config(setup.config.to_dict())
    state = _TrainingState(params=_initial_params(setup), ledger=_resumed_ledger(run, setup.config, done))
    if done > 0:
        stored_params = run.checkpoints.params(done, setup.device)
        # safetensors returns names sorted; keep the model's order, which fixes the order of floating-point sums
        state.params = {name: stored_params[name] for name in state.params}
        state.states = ClientStates(run, setup.device, upto=done)
        state.server_state = run.states.load_server(done, setup.device)
        state.server_kept = run.states.load_server(done, setup.device, kept=True)
    state.rows = run.read_metrics(server=True).to_dict("records")[:done]
    manifest = _manifest(setup, rounds_done=done, created=manifest.created, randomness=randomness)
    if done == setup.config.federated.rounds:
        echo(f"{run.path} has already completed all {done} rounds; nothing to do.")
    return _run_rounds(setup, run, manifest, state, randomness, progress=progress, echo=echo)


def evaluate(
    model: torch.nn.Module,
    params: TensorDict,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = EVAL_BATCH,
    *,
    sites: tuple[int, ...] = (),
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of the model with ``params`` on (x, y); with ``sites`` (the sizes of each
    site's part of the test split, in order) as a federation whose sites keep their records evaluates it: each
    site counts on its own records and the counts are added."""
    parts = [len(y)] if not sites else list(sites)
    correct, total_loss, start = 0, 0.0, 0
    for size in parts:
        right, loss, _ = evaluation_counts(model, params, x[start : start + size], y[start : start + size], batch_size)
        correct, total_loss, start = correct + right, total_loss + loss, start + size
    return correct / len(y), total_loss / len(y)


class ClientStates:
    """What clients keep between rounds (SCAFFOLD's c_k, FedLAP's last synthetic set, Fedssyn's dealt share).

    A state is held in memory only from the round that changes it to that round's commit; after that it is read back
    from the round file that holds it (``checkpoints/round-N-clients.safetensors`` holds the states round N changed).
    So memory and each round's writes grow with a round's clients, not with every client that ever took part, as a
    cross-device federation needs. Without a run directory (a timed round) every state stays in memory.
    """

    def __init__(self, run: RunDirectory | None = None, device: str | torch.device = "cpu", upto: int = 0) -> None:
        self.run, self.device = run, device
        self.where: dict[int, int] = {} if run is None else run.states.index(upto)  # client -> its round file
        self.changed: dict[int, TensorDict] = {}  # changed since the last commit

    def __bool__(self) -> bool:
        return bool(self.where or self.changed)

    def of(self, clients: Iterable[int]) -> dict[int, TensorDict]:
        """The current states of those of ``clients`` that have one."""
        wanted = list(clients)
        found = {k: self.changed[k] for k in wanted if k in self.changed}
        stored = {k: self.where[k] for k in wanted if k not in self.changed and k in self.where}
        if stored:
            assert self.run is not None
            found.update(self.run.states.read(stored, self.device))
        return found

    def set(self, client: int, state: TensorDict) -> None:
        self.changed[client] = state

    def merge(self, client: int, extra: TensorDict) -> None:
        """Add ``extra``'s tensors to the client's state (the server's dealt records)."""
        self.changed[client] = {**self.of([client]).get(client, {}), **extra}

    def carried(self, removed: int, number: int) -> dict[int, TensorDict]:
        """The states in round ``removed``'s file (about to be removed by --keep-checkpoints) that the next round still
        needs: those of clients the next round's file does not hold (round ``number``'s file, if it is the next, holds
        the states it changed). They move to that file, the oldest kept round's, where every kept round finds them."""
        assert self.run is not None, "only a run directory's rounds are removed"
        nxt = set(self.changed) if removed + 1 == number else self.run.states.clients_in(removed + 1)
        clients = self.run.states.clients_in(removed) - nxt
        return self.run.states.load(removed, self.device, clients) if clients else {}

    def committed(self, number: int, carried: Mapping[int, TensorDict], into: int) -> None:
        """Round ``number``'s file now holds the states it changed, and round ``into``'s the ``carried`` ones: from now
        on each client's latest state is read back from the latest file that holds it."""
        assert self.run is not None, "only a run directory's rounds are committed"
        self.where.update({k: max(into, self.where.get(k, 0)) for k in carried})
        self.where.update(dict.fromkeys(self.changed, number))
        self.changed.clear()


@dataclass
class _TrainingState:
    """What the round loop carries from round to round (and what a resume restores)."""

    params: TensorDict
    ledger: PrivacyLedger | None
    rows: list[dict[str, Any]] = field(default_factory=list)  # metrics.csv so far
    states: ClientStates = field(default_factory=ClientStates)  # what clients keep between rounds
    server_state: TensorDict = field(default_factory=dict)  # what the server broadcasts besides the weights
    server_kept: TensorDict = field(default_factory=dict)  # what the server keeps to itself


@dataclass(frozen=True)
class _RoundOutcome:
    """One computed round, before it is committed to the run directory."""

    round: int  # 1-based
    params: TensorDict
    server_state: TensorDict
    server_kept: TensorDict
    messages: list[ClientMessage]
    server_metrics: dict[str, float]
    row: dict[str, Any]
    summed: ClientMessage | None = None  # the payloads the server received only added up (secure aggregation)


def _initial_params(setup: Setup) -> TensorDict:
    """The global model at round 0, drawn from the run's seed (in the model's parameter order)."""
    return initial_params(setup.spec, setup.config.seed)


def _new_ledger(config: RunConfig) -> PrivacyLedger | None:
    if not config.privacy.dp:
        return None
    return PrivacyLedger(
        accountant=config.privacy.accountant,
        delta=accountant_delta(config),
        noise_multiplier=config.privacy.noise_multiplier,
        max_grad_norm=config.privacy.max_grad_norm,
        unit=config.privacy.dp_level,
        max_update_norm=config.privacy.max_update_norm,
    )


def _resumed_ledger(run: RunDirectory, config: RunConfig, done: int) -> PrivacyLedger | None:
    """The stored ledger as of the last committed round (privacy.json may be a round ahead of the manifest), at the
    delta of the resumed configuration: with the noise in shares, more rounds leave less of --delta to the
    accountant (:func:`fedaudit.config.accountant_delta`), and every round is then accounted at that delta, as a run
    started with those rounds would be."""
    if not config.privacy.dp:
        return None
    stored = run.read_privacy()
    if not stored:
        ledger = _new_ledger(config)
    else:
        ledger = PrivacyLedger.from_dict(stored).truncated(done).at_delta(accountant_delta(config))
    if ledger.rounds != done:
        raise RunError(
            f"{run.privacy_path} records {ledger.rounds} rounds but the manifest says {done}; the run is inconsistent."
        )
    return ledger


def _diverged(m: int, config: RunConfig, what: str) -> TrainingError:
    """The one sentence of a round that diverged, with what to lower: the step size, or under DP also the noise."""
    kept = f"with {m} rounds kept" if m else "and nothing is kept"
    fed, priv = config.federated, config.privacy
    noise = ""
    if priv.dp and priv.noise_multiplier is not None:
        norm = priv.max_update_norm if priv.client_level else priv.max_grad_norm
        noise = f", or the noise (--noise-multiplier {priv.noise_multiplier:g}" + (
            f" with a clipping norm of {norm:g})" if norm is not None else ")"
        )
    return TrainingError(
        f"Round {m + 1} diverged: {what}, so training stops {kept}; lower --lr (now {fed.client_lr:g}) or the "
        f"local epochs{noise}, then start again."
    )


def _refuse_new_rounds_for_a_round_in_flight(
    run: RunDirectory, manifest: Manifest, config: RunConfig, rounds: int | None, settings: Mapping[str, Any] | None
) -> None:
    """A deployment's site answers a round once, for one set of inputs (the run's rounds among them: the learning
    rate's schedule spans them). A run stopped in a round may have had it answered by some sites: resumed with other
    rounds, the others would answer it for those, and no setting would ever again suit them all. Such a run resumes
    with the rounds it was sent with; it is extended once that round is done."""
    superlink = (settings or {}).get("superlink") or config.flower.superlink
    at_sites = config.engine == "flower" and superlink is not None
    secret = manifest.randomness_source == CLIENT_SECRETS
    if at_sites and secret and manifest.status != "complete" and rounds not in (None, config.federated.rounds):
        raise TrainingError(
            f"{run.path} stopped in round {manifest.rounds_done + 1}, which its sites may have answered for "
            f"--rounds {config.federated.rounds} already (a site answers a round once, for one set of inputs); "
            f"resume it with --rounds {config.federated.rounds} (or none), then extend it."
        )


def _at_sites(config: RunConfig) -> bool:
    """Whether the clients are a Flower deployment's sites, which keep their own secrets."""
    return config.engine == "flower" and config.flower.superlink is not None


def _manifest(setup: Setup, *, rounds_done: int, created: str, randomness: RunRandomness) -> Manifest:
    config, dataset = setup.config, setup.dataset
    return Manifest(
        status="running",
        rounds_done=rounds_done,
        rounds=config.federated.rounds,
        created=created,
        algorithm=config.federated.algorithm,
        dp=config.privacy.dp,
        engine=config.engine,
        device=str(setup.device),
        versions=versions(),
        dataset=DatasetRecord(
            name=dataset.name,
            source=dataset.source,
            fingerprint=dataset.fingerprint,
            train_size=sum(r.records for r in setup.sites) if setup.sites else int(len(dataset.train_y)),
            test_size=sum(r.tests for r in setup.sites) if setup.sites else int(len(dataset.test_y)),
        ),
        model=ModelRecord(
            arch=setup.spec.arch,
            input_shape=tuple(setup.spec.input_shape),
            num_classes=setup.spec.num_classes,
            width=setup.spec.width,
            depth=setup.spec.depth,
            num_parameters=num_parameters(build_model(setup.spec)),
        ),
        clients=ClientsRecord(
            num_examples=tuple(int(len(idx)) for idx in setup.partition.clients),
            holdout=int(len(setup.partition.holdout)),
            client_fraction_effective=setup.client_fraction,
            dp_queries_per_round=tuple(setup.queries[k] for k in range(len(setup.partition.clients))),
        ),
        randomness=RandomnessRecord(source=randomness.source, run_id=randomness.run_id),
    )


def _round_privacy_events(
    setup: Setup, messages: list[ClientMessage], round_index: int, selected: list[int]
) -> dict[int, list[SGMEvent]]:
    """Per selected client, this round's SGM events: the worst case of the plan and of what the client reported.

    A client is charged for the rounds it was selected for, in full: no discount for client sampling, because the
    server knows whom it selected (docs/accounting.md). A selected client whose reply never came is charged too:
    it may have computed and sent. T = max(planned worst case, queries actually made). An algorithm that plans its
    own events (:func:`fedaudit.algorithms.base.privacy_plan`) is charged its plan, and more steps where a client
    reported more queries at some (sigma, q) than planned.
    """
    priv = setup.config.privacy
    if priv.client_level:  # every client, sampled or not, is charged the round's one SGM at the server's rate q
        event = round_events(
            noise_multiplier=priv.noise_multiplier, sample_rate=setup.client_fraction, queries_per_round=1
        )
        return {k: event for k in range(setup.config.data.num_clients)}
    reported = {m.client_id: m.privacy_events for m in messages}
    events: dict[int, list[SGMEvent]] = {}
    for k in sorted(set(selected) | set(reported)):
        q = setup.sample_rates[k]
        made = reported.get(k, [])
        planned = privacy_plan(setup.algorithm, setup.config, len(setup.partition.clients[k]), round_index)
        if planned is not None:
            events[k] = _at_least(planned, made)
            continue
        steps = max(setup.queries[k], sum(e.steps for e in made))
        rate = max([q, *(e.sample_rate for e in made)])
        sigma = min([priv.noise_multiplier, *(e.noise_multiplier for e in made)])
        events[k] = round_events(noise_multiplier=sigma, sample_rate=rate, queries_per_round=steps)
    return events


def _at_least(planned: list[SGMEvent], made: list[SGMEvent]) -> list[SGMEvent]:
    """The planned events, each (sigma, q) with at least as many steps as the client reported at it."""
    steps = {(e.noise_multiplier, e.sample_rate): e.steps for e in compose(planned)}
    for e in compose(made):
        key = (e.noise_multiplier, e.sample_rate)
        steps[key] = max(steps.get(key, 0), e.steps)
    return compose(SGMEvent(noise_multiplier=s, sample_rate=q, steps=n) for (s, q), n in steps.items())


def time_first_round(setup: Setup) -> float:
    """Seconds the first round of ``setup`` takes on this machine (its clients on the local engine, the server
    update, the evaluation), computed and thrown away: nothing is written. ``fedaudit compare`` estimates a study's
    duration from it before it starts."""
    repeatable(setup.device)
    params = {name: p.to(setup.device) for name, p in _initial_params(setup).items()}
    state = _TrainingState(params=params, ledger=_new_ledger(setup.config))
    began = time.perf_counter()
    randomness = RunRandomness.for_config(setup.config, new_run_id(), at_sites=False)  # secrets in memory only
    with LocalEngine(progress=False, echo=None, parallel=setup.config.parallel_clients) as engine:
        _RoundLoop(setup, None, engine, randomness).compute(0, state)
    return time.perf_counter() - began


def isolated_round(
    setup: Setup,
    params: Mapping[str, torch.Tensor],
    keys: ClientKeys,
    records: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ClientMessage:
    """One first round of client 0 at the global ``params``, as the training loop runs a client (no server state,
    no canaries), with ``keys`` for its draws and ``records`` in place of its own where given; nothing is written.
    The sandbox of the sensitivity probe (attacks/conformance/probe.py), which intercepts the round's DP queries."""
    device = setup.device
    if records is None:
        own = client_data(replace(setup, canaries=None), 0)
        records = own.x, own.y
    data = ClientData(0, records[0].to(device), records[1].to(device))
    ctx = RoundContext(round=0, rounds=setup.config.federated.rounds, config=setup.config, device=device)
    model = build_model(setup.spec).to(device)
    start = {name: p.detach().clone().to(device) for name, p in params.items()}
    return run_client(setup.algorithm, model, start, data, ctx, keys)


class _RoundLoop:
    """The rounds of one training session: the clients' data and the test split on the device, a scratch model
    (``run`` is None for a round that is timed and not kept)."""

    def __init__(self, setup: Setup, run: RunDirectory | None, engine: Engine, randomness: RunRandomness) -> None:
        self.setup, self.run, self.engine, self.randomness = setup, run, engine, randomness
        device, dataset = setup.device, setup.dataset
        # every client's data is built once when every client takes part in every round; with client sampling,
        # only the round's participants' are built, each round, so that memory grows with the clients of a round
        # and not with the federation (a thousand clients, a few of them a round)
        self.every_round = setup.client_fraction >= 1.0
        self._clients: dict[int, ClientData] = {}
        sample = setup.config.evaluation.eval_sample
        if sample is not None and sample < len(dataset.test_y):
            chosen = np.sort(numpy_rng(setup.config.seed, Stream.EVALUATION).choice(len(dataset.test_y), sample, False))
            index = torch.from_numpy(chosen)
            self.test = dataset.test_x[index].to(device), dataset.test_y[index].to(device)
        else:
            self.test = dataset.test_x.to(device), dataset.test_y.to(device)
        self.model = build_model(setup.spec).to(device)
        # a client-level DP server samples the clients and noises their sum from its own secret, written now
        self.server_keys = None
        if setup.config.privacy.client_level:
            self.server_keys = randomness.server_keys(None if run is None else run.server_secret_path)
        priv = setup.config.privacy
        self.canaries = None  # --canary-clients, and those the round under way sampled
        self._sampled_canaries = np.zeros(0, dtype=np.int64)
        if setup.config.audit.canary_clients:
            self.canaries = RunCanaries(
                setup.config.audit.canary_clients,
                setup.config.seed,
                clipping_norm=priv.max_update_norm,
                noise_multiplier=priv.noise_multiplier,
                delta=priv.delta,
            )

    def participants(self, m: int) -> list[int]:
        """The clients of round ``m``: from the seed alone, or at client level each client with probability q from
        the server's secret (a sample the models' observers cannot know, which the accountant's amplification by
        sampling needs)."""
        setup = self.setup
        if self.server_keys is None:
            return round_participants(setup.config, setup.algorithm, m)
        source = self.server_keys.query_source(m, SERVER_SAMPLE, "cpu")
        chosen = poisson_sample(setup.config.data.num_clients, setup.client_fraction, generator=source).tolist()
        if self.canaries is not None:  # then one draw per canary client, from the same source
            drawn = poisson_sample(self.canaries.count, setup.client_fraction, generator=source).numpy()
            self._sampled_canaries = drawn[self.canaries.included[drawn].astype(bool)]
        return chosen

    def _begin_canaries(self, m: int, state: _TrainingState) -> None:
        """The canary clients' space on the first round this process computes: the round-0 model, and for a resumed
        run the log of the rounds it committed."""
        if self.canaries is None or self.canaries.space.initial is not None:
            return
        initial = flat(initial_params(self.setup.spec, self.setup.config.seed))
        if m == 0:
            self.canaries.space.begin(initial)
            return
        assert self.run is not None
        self.canaries.resumed(read_log(self.run.canary_clients_path), m, initial, flat(state.params))

    def _run_clients(self, selected: list[int], ctx: RoundContext, state: _TrainingState) -> list[ClientMessage]:
        """The round's clients on the engine, each with its secret (made and written now for a client taking part
        for the first time, before anything is drawn from it); their kept states stored."""
        self.randomness.prepare(selected, None if self.run is None else self.run.secrets_path)
        messages = []
        if selected:  # a client-level round may sample no client: its release is the noise alone
            messages = self.engine.run_clients(
                self.setup.algorithm,
                self.model,
                state.params,
                [self.client(k) for k in selected],
                ctx,
                self.randomness.keys,
                state.states.of(selected),
            )
        if not self.every_round:
            self._clients.clear()
        for msg in messages:
            if msg.state:
                state.states.set(msg.client_id, msg.state)
        return messages

    def _canary_messages(self, params: TensorDict) -> list[ClientMessage]:
        """What the canary clients sampled this round send the server (never stored, never counted as traffic)."""
        if self.canaries is None:
            return []
        first = self.setup.config.data.num_clients
        messages = []
        for i, row in zip(self._sampled_canaries, self.canaries.updates(self._sampled_canaries)):
            payload, start = {}, 0
            for name, p in params.items():  # the flattened row, cut into the parameters' shapes in their order
                payload[name] = torch.from_numpy(row[start : start + p.numel()].reshape(p.shape)).to(p.device, p.dtype)
                start += p.numel()
            messages.append(ClientMessage(client_id=first + int(i), num_examples=0, payload=payload))
        return messages

    def client(self, k: int) -> ClientData:
        """Client ``k``'s data on the device (at a site that keeps its records, only its id: the site has them)."""
        if k not in self._clients:
            setup = self.setup
            if setup.records_at_sites:
                empty = setup.dataset.train_x[:0].to(setup.device), setup.dataset.train_y[:0].to(setup.device)
                self._clients[k] = ClientData(k, *empty)
            else:
                self._clients[k] = client_data(setup, k)
        return self._clients[k]

    def compute(self, m: int, state: _TrainingState) -> _RoundOutcome:
        """Round ``m`` (0-based): select clients, run them on the engine, update the server, account, evaluate."""
        setup, config, device = self.setup, self.setup.config, self.setup.device
        began = time.perf_counter()
        rounds = config.federated.rounds
        self._begin_canaries(m, state)
        selected = self.participants(m)
        ctx = RoundContext(
            round=m,
            rounds=rounds,
            config=config,
            device=device,
            server_state=state.server_state,
            server_kept=state.server_kept,
            run_id=self.randomness.run_id,
            population=config.data.num_clients + (self.canaries.population if self.canaries is not None else 0),
            participants=len(selected) + (len(self._sampled_canaries) if self.canaries is not None else 0),
        )
        messages = self._run_clients(selected, ctx, state)
        summed = self.engine.take_secure_sum() if selected else None
        if self.server_keys is not None:
            server = self.server_keys.query_source(m, SERVER_NOISE, device)
        else:
            server = make_generator(config.seed, Stream.SERVER, m, device=device)
        canary = self._canary_messages(state.params)
        received = [*messages, *([] if summed is None else [summed]), *canary]
        result = setup.algorithm.server_update(self.model, state.params, received, ctx, server)
        for k, dealt in result.dealt.items():
            state.states.merge(k, dealt)
        params = clone_params(result.params)
        if not all(bool(torch.isfinite(p).all()) for p in params.values()):
            raise _diverged(m, config, "the global model's weights are no longer finite (NaN or infinity)")
        if self.canaries is not None:  # the count sampled is not logged: the audit reads the Poisson rate, and the
            # log goes to others with the run, while the count is the server's sample (fedaudit.rundir.private)
            self.canaries.record(flat(state.params), flat(params), 0, ctx.population, setup.client_fraction)
        wall = time.perf_counter() - began
        epsilon = math.inf
        if state.ledger is not None:
            epsilon = state.ledger.record_round(_round_privacy_events(setup, messages, m, selected))
        every = config.evaluation.eval_every
        if (m + 1) % every and m + 1 != rounds:
            accuracy = loss = math.nan  # not measured this round (--eval-every)
        elif setup.records_at_sites:
            accuracy, loss = self.engine.evaluate_at_sites(params, m + 1)
        else:
            accuracy, loss = evaluate(self.model, params, *self.test, sites=setup.dataset.test_sites)
        if math.isinf(loss) or (math.isnan(loss) and not math.isnan(accuracy)):  # finite weights, overflowing outputs
            raise _diverged(m, config, "the global model's test loss is no longer finite (its outputs overflow)")
        numbers = {key: value for key, value in result.metrics.items() if isinstance(value, (int, float))}
        row = {
            "round": m + 1,
            "test_accuracy": accuracy,
            "test_loss": loss,
            "epsilon": epsilon,
            "wall_seconds": wall,
            "bytes_up": sum(msg.nbytes for msg in messages) + (0 if summed is None else summed.nbytes * len(messages)),
            "clients": len(messages),
            **({"sampled": len(selected) + len(canary)} if self.canaries is not None else {}),  # canaries too
            **numbers,
            **self._salted(m + 1),
        }
        return _RoundOutcome(
            round=m + 1,
            params=params,
            server_state=clone_params(result.state),
            server_kept=clone_params(result.kept),
            messages=messages,
            server_metrics=numbers,
            row=row,
            summed=summed,
        )

    def commit(self, outcome: _RoundOutcome, state: _TrainingState, manifest: Manifest) -> Manifest:
        """Write the round: checkpoint, client states, transmitted payloads, model, metrics, ledger, and the manifest
        last (the commit point a resume trusts)."""
        run = self.run
        assert run is not None, "a timed round is not committed"
        state.params, state.server_state, state.server_kept = outcome.params, outcome.server_state, outcome.server_kept
        state.rows.append(outcome.row)
        clients = [{"client": msg.client_id, "bytes_up": msg.nbytes, **msg.metrics} for msg in outcome.messages]
        carried = self._carried(outcome.round, state)
        with run.staged():
            manifest = self._write_round(outcome, state, manifest, clients, carried)
        keep = self.setup.config.keep_checkpoints
        state.states.committed(outcome.round, carried, outcome.round - keep + 1 if keep is not None else outcome.round)
        if keep is not None and outcome.round > keep:
            # only once the round is committed: a resume from round N - 1 still finds what round N - K's files held
            run.remove([p for old in range(1, outcome.round - keep + 1) for p in run.checkpoints.files(old)])
        return manifest

    def _salted(self, round_number: int) -> dict[str, str]:
        """A client-level run's salt of its private records of a round (fedaudit.rundir.private): the copy's
        manifest keeps their hashes, which a guess of the round's sample would otherwise match. From the server's
        secret, so that a resumed run writes the same records; {} for other runs."""
        if self.server_keys is None:
            return {}
        return {SALT: self.server_keys.query_key(round_number, SERVER_SALT).hex()[:32]}

    def _write_round(
        self,
        outcome: _RoundOutcome,
        state: _TrainingState,
        manifest: Manifest,
        clients: list[dict[str, Any]],
        carried: Mapping[int, TensorDict],
    ) -> Manifest:
        run, config, number = self.run, self.setup.config, outcome.round
        assert run is not None
        run.checkpoints.save(
            number,
            outcome.params,
            {
                **_checkpoint_state(config.seed, number),
                "clients": clients,
                "server": outcome.server_metrics,
                **self._salted(number),
            },
        )
        states = dict(state.states.changed)
        into = number - config.keep_checkpoints + 1 if config.keep_checkpoints is not None else number
        if carried and into == number:
            states = {**carried, **states}
        if states or (config.privacy.client_level and getattr(self.setup.algorithm, "keeps_client_states", False)):
            run.states.save(number, states, self._salted(number).get(SALT))  # at client level every round: which
            # rounds changed a state would tell the sample
        if carried and into < number:
            loaded = run.states.load(into, self.setup.device)
            run.states.save(into, {**carried, **loaded}, self._salted(into).get(SALT))
        if state.server_state:
            run.states.save_server(number, state.server_state)
        if state.server_kept:
            run.states.save_server(number, state.server_kept, kept=True)
        if config.save_transmitted:
            for msg in outcome.messages:
                if msg.payload:  # an empty one reached the server only inside the secure sum
                    run.wire.save(number, msg.client_id, msg.payload)
            if outcome.summed is not None:
                run.wire.save_sum(number, [msg.client_id for msg in outcome.messages], outcome.summed.payload)
        if self.setup.canaries is not None:
            run.queries.save(number, {msg.client_id: msg.audit for msg in outcome.messages})
        if self.canaries is not None:
            run.put(run.canary_clients_path, self.canaries.to_log(strategy=_canary_strategy(config)).to_bytes())
        run.save_model(outcome.params, {"round": str(number), "algorithm": config.federated.algorithm})
        columns = {key for row in state.rows for key in row}
        run.write_metrics(state.rows, private_columns(columns, client_level=config.privacy.client_level))
        if state.ledger is not None:
            run.write_privacy(state.ledger.to_dict())
        done = number == config.federated.rounds
        manifest = manifest.advanced(rounds_done=number, status="complete" if done else "running")
        run.write_manifest(manifest)
        return manifest

    def _carried(self, number: int, state: _TrainingState) -> dict[int, TensorDict]:
        """With --keep-checkpoints K: the client states that round number - K's file holds and a kept round needs."""
        keep = self.setup.config.keep_checkpoints
        return state.states.carried(number - keep, number) if keep is not None and number > keep else {}


def _run_rounds(
    setup: Setup,
    run: RunDirectory,
    manifest: Manifest,
    state: _TrainingState,
    randomness: RunRandomness,
    *,
    progress: bool,
    echo: Echo,
) -> TrainResult:
    """Compute and commit every round left; an interruption or failure is recorded in the manifest and re-raised."""
    repeatable(setup.device)
    rounds, start = setup.config.federated.rounds, manifest.rounds_done
    state.params = {name: p.to(setup.device) for name, p in state.params.items()}
    accuracy = float(state.rows[-1]["test_accuracy"]) if state.rows else math.nan
    with make_engine(
        setup.config,
        num_clients=len(setup.partition.clients),
        progress=progress,
        echo=echo,
        membership=setup.partition.clients,
        sites=setup.sites if setup.records_at_sites else (),
    ) as engine:
        loop = _RoundLoop(setup, run, engine, randomness)
        try:
            for m in tqdm(
                range(start, rounds), desc="rounds", unit="round", initial=start, total=rounds, disable=not progress
            ):
                outcome = loop.compute(m, state)
                manifest = loop.commit(outcome, state, manifest)
                run.publish()  # a new run appears at --out with its first committed round
                accuracy = outcome.row["test_accuracy"]
                echo(_round_line(outcome.row, rounds, dp=state.ledger is not None, config=setup.config))
        except KeyboardInterrupt:
            run.write_manifest(manifest.advanced(status="interrupted"))
            raise
        except BaseException:
            run.write_manifest(manifest.advanced(status="failed"))
            raise
    if start == rounds:
        run.write_manifest(manifest.advanced(status="complete"))
    epsilon = state.ledger.epsilon if state.ledger is not None else math.inf
    return TrainResult(run_dir=run.path, rounds_done=rounds, test_accuracy=accuracy, epsilon=epsilon)


def flat(params: TensorDict) -> np.ndarray:
    """A model's parameters, in their order, as one float64 vector (the canary clients' space)."""
    return np.concatenate([p.detach().cpu().double().numpy().ravel() for p in params.values()])


def _canary_strategy(config: RunConfig) -> str:
    """What the canary clients' log says was audited."""
    return f"{algorithm_label(config.federated.algorithm, True, 'client')}, fixed clipping, noise at the server"


def _round_line(row: dict[str, Any], rounds: int, *, dp: bool, config: RunConfig) -> str:
    label_epsilon = config.fedgm.label_epsilon if ALGORITHMS[config.federated.algorithm].label_dp else None
    if dp:
        eps_text = f"epsilon {row['epsilon']:.3f}"
    elif label_epsilon is not None:
        eps_text = f"no record-level DP, labels {label_epsilon:g}-label-DP"
    else:
        eps_text = "no DP"
    measured = (
        "not evaluated (--eval-every)"
        if math.isnan(row["test_accuracy"])
        else f"test accuracy {row['test_accuracy']:.4f}, loss {row['test_loss']:.4f}"
    )
    return (
        f"round {row['round']}/{rounds}: {measured}, {eps_text}, {row['wall_seconds']:.1f}s, "
        f"{row['bytes_up'] / 1e6:.2f} MB up"
    )


def _checkpoint_state(seed: int, round_number: int) -> dict[str, Any]:
    """What is saved beside a checkpoint's weights: the round, the seed every public random stream is derived from
    (seed, stream, round, client), and the Python version, for the record. Not torch's global generator: nothing
    of a run draws from it (a model's initialisation puts it back as it found it), so its state would record only
    what the calling process did before."""
    return {
        "round": round_number,
        "seed": seed,
        "rng": "public draws per (seed, stream, round, client), see fedaudit.seeding; a DP run's clients draw from "
        "their own keys, see fedaudit.privacy.randomness",
        "python": sys.version.split()[0],
    }

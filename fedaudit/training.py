"""The shared training core: set up a run, run its rounds, checkpoint, account, resume.

Every algorithm goes through :func:`train` / :func:`resume`: data and
partition, model initialisation, client selection, the engine that runs the
clients, the server update, evaluation, the privacy ledger and the run
directory are the same for all of them.
"""

from __future__ import annotations

import base64
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fedaudit.algorithms import get_algorithm
from fedaudit.algorithms.base import Algorithm, ClientData, RoundContext, TensorDict, clone_params, load_params
from fedaudit.config import RunConfig, mark_calibrated
from fedaudit.data import Dataset, Partition, load_dataset, partition_dataset
from fedaudit.engine import make_engine
from fedaudit.models import ModelSpec, build_model, default_depth, num_parameters
from fedaudit.privacy.accounting import PrivacyLedger, SGMEvent, calibrate_noise_multiplier, round_events
from fedaudit.runs import RunDirectory, RunError, now_iso, remove_stale_temporaries, versions
from fedaudit.seeding import Stream, derive_seed, make_generator, numpy_rng, repeatable

Echo = Callable[[str], None]


class TrainingError(ValueError):
    """A run that cannot be set up as configured (one clear sentence)."""


@dataclass
class Setup:
    """Everything a run needs, validated before any file is written."""

    config: RunConfig
    dataset: Dataset
    partition: Partition
    spec: ModelSpec
    device: torch.device
    algorithm: Algorithm
    client_fraction: float  # effective selection probability ceil(p K) / K
    queries: dict[int, int]  # worst-case DP queries per round, per client
    sample_rates: dict[int, float]  # B / N_k per client (DP only)


@dataclass(frozen=True)
class TrainResult:
    """Where the run went and how it ended."""

    run_dir: Path
    rounds_done: int
    test_accuracy: float
    epsilon: float


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without one is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("--device cuda was requested but no CUDA device is available; use --device cpu or auto.")
    return torch.device(name)


def prepare(config: RunConfig, *, device: str | None = None) -> Setup:
    """Resolve and check a configuration, load the data and build the partition; writes nothing."""
    config = config.resolved()
    if config.engine == "flower":
        from fedaudit.engine.flower import flower_available

        missing = flower_available()
        if missing:
            raise TrainingError(missing)
    dataset = load_dataset(config.data.dataset, config.data.data_dir, download=config.data.download)
    partition = partition_dataset(
        dataset.train_y.numpy(),
        num_clients=config.data.num_clients,
        scheme=config.data.partition,
        seed=config.seed,
        holdout_fraction=config.data.holdout_fraction,
    )
    if config.model.depth is None:
        config = replace(
            config, model=replace(config.model, depth=default_depth(config.model.arch, dataset.input_shape))
        )
    spec = ModelSpec(
        arch=config.model.arch,
        input_shape=dataset.input_shape,
        num_classes=dataset.num_classes,
        width=config.model.width,
        depth=config.model.depth,
    )
    build_model(spec)  # fail early on a model that cannot be built for this input
    algorithm = get_algorithm(config)
    sizes = {k: int(len(idx)) for k, idx in enumerate(partition.clients)}
    selected = clients_per_round(config.federated.client_fraction, config.data.num_clients)
    client_fraction = selected / config.data.num_clients
    queries = {k: algorithm.queries_per_round(config, n) for k, n in sizes.items()}
    sample_rates: dict[int, float] = {}
    if config.privacy.dp:
        batch = config.federated.batch_size
        smallest = min(sizes.values())
        if batch > smallest:
            raise TrainingError(
                f"--batch-size {batch} exceeds the smallest client's {smallest} records, so the DP sampling rate "
                f"B / N_k would exceed 1; use a batch size of at most {smallest}."
            )
        sample_rates = {k: batch / n for k, n in sizes.items()}
        if config.privacy.noise_multiplier is None:
            sigma = max(
                calibrate_noise_multiplier(
                    target_epsilon=config.privacy.target_epsilon,
                    sample_rate=q,
                    queries_per_round=queries[k],
                    rounds=config.federated.rounds,
                    client_fraction=client_fraction,
                    delta=config.privacy.delta,
                    accountant=config.privacy.accountant,
                )
                for k, q in sample_rates.items()
            )
            config = mark_calibrated(config, sigma)
    return Setup(
        config=config,
        dataset=dataset,
        partition=partition,
        spec=spec,
        device=resolve_device(device or config.device),
        algorithm=algorithm,
        client_fraction=client_fraction,
        queries=queries,
        sample_rates=sample_rates,
    )


def train(
    config: RunConfig, out: str | Path, *, overwrite: bool = False, progress: bool = True, echo: Echo = tqdm.write
) -> TrainResult:
    """Train a new run into ``out`` (validated fully before the directory is touched)."""
    return train_setup(prepare(config), out, overwrite=overwrite, progress=progress, echo=echo)


def train_setup(
    setup: Setup, out: str | Path, *, overwrite: bool = False, progress: bool = True, echo: Echo = tqdm.write
) -> TrainResult:
    """Train a new run from an already prepared (validated, calibrated) :class:`Setup`."""
    run = RunDirectory(out)
    run.prepare_new(overwrite)
    run.write_config(setup.config.to_dict())
    run.write_membership(setup.partition.to_arrays())
    torch.manual_seed(derive_seed(setup.config.seed, Stream.INIT))
    model = build_model(setup.spec)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    ledger = _new_ledger(setup.config) if setup.config.privacy.dp else None
    manifest = _manifest(setup, status="running", rounds_done=0, created=now_iso())
    run.write_manifest(manifest)
    return _run_rounds(setup, run, manifest, params, ledger, [], {}, start=0, progress=progress, echo=echo)


def resume(
    run_dir: str | Path,
    *,
    rounds: int | None = None,
    device: str | None = None,
    progress: bool = True,
    echo: Echo = tqdm.write,
) -> TrainResult:
    """Continue an interrupted run from its last completed round (optionally extending ``rounds``).

    ``device`` overrides where the rest of the run trains (the results do not depend on it).
    """
    run = RunDirectory(run_dir)
    manifest = run.read_manifest()
    config = RunConfig.from_dict(run.read_config())
    done = int(manifest.get("rounds_done", 0))
    if rounds is not None:
        if rounds < done:
            raise TrainingError(f"--rounds {rounds} is fewer than the {done} rounds {run.path} has already completed.")
        if config.privacy.dp and config.privacy.target_epsilon is not None and rounds > config.federated.rounds:
            raise TrainingError(
                f"{run.path} calibrated its noise for --target-epsilon {config.privacy.target_epsilon:g} over "
                f"{config.federated.rounds} rounds; more rounds would spend more than that budget, so start a new run."
            )
        config = replace(config, federated=replace(config.federated, rounds=rounds))
    setup = prepare(config, device=device)
    if setup.dataset.fingerprint != manifest["dataset"]["fingerprint"]:
        raise RunError(
            f"The {config.data.dataset} data found now differs from the data {run.path} was trained on (fingerprint mismatch)."
        )
    stored = run.read_membership()
    if any(not np.array_equal(stored[key], value) for key, value in setup.partition.to_arrays().items()):
        raise RunError(
            f"The partition rebuilt from the seed differs from {run.membership_path}; the run cannot be resumed."
        )
    remove_stale_temporaries(run.path)  # half-written files of the interrupted process
    run.write_config(setup.config.to_dict())
    states: dict[int, TensorDict] = {}
    if done > 0:
        stored_params, _state = run.load_checkpoint(done, setup.device)
        # safetensors returns names sorted; keep the model's order, which fixes the order of floating-point sums
        params = {name: stored_params[name] for name, _ in build_model(setup.spec).named_parameters()}
        states = run.load_client_states(done, setup.device)
    else:
        torch.manual_seed(derive_seed(setup.config.seed, Stream.INIT))
        params = {name: p.detach().clone() for name, p in build_model(setup.spec).named_parameters()}
    ledger = None
    if setup.config.privacy.dp:
        stored_ledger = run.read_privacy()
        ledger = _ledger_upto(stored_ledger, done) if stored_ledger else _new_ledger(setup.config)
        if ledger.rounds != done:
            raise RunError(
                f"{run.privacy_path} records {ledger.rounds} rounds but the manifest says {done}; the run is inconsistent."
            )
    rows = run.read_metrics().to_dict("records")[:done]
    manifest = {
        **manifest,
        **_manifest(setup, status="running", rounds_done=done, created=manifest.get("created", now_iso())),
    }
    if done == setup.config.federated.rounds:
        echo(f"{run.path} has already completed all {done} rounds; nothing to do.")
    return _run_rounds(setup, run, manifest, params, ledger, rows, states, start=done, progress=progress, echo=echo)


def equal_data_access(config: RunConfig) -> list[str]:
    """The DP-FedAvg settings that make as many DP queries per round as ``config`` (the paper's fair comparison)."""
    setup = prepare(config)
    queries = max(setup.queries.values())
    smallest = min(len(idx) for idx in setup.partition.clients)
    per_epoch = max(1, smallest // setup.config.federated.batch_size)
    epochs = max(1, round(queries / per_epoch))
    return [
        f"{setup.config.federated.algorithm} makes {queries} DP queries per client per round "
        f"(batch {setup.config.federated.batch_size}, smallest client {smallest} records, {per_epoch} batches per epoch).",
        f"DP-FedAvg at equal data access: --algorithm fedavg --local-steps {queries} "
        f"(nearest whole epochs: --local-epochs {epochs} = {epochs * per_epoch} queries).",
    ]


def evaluate(
    model: torch.nn.Module, params: TensorDict, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of the model with ``params`` on (x, y)."""
    load_params(model, params)
    model.eval()
    correct, total_loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            logits = model(xb)
            total_loss += float(F.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(dim=1) == yb).sum())
    return correct / len(y), total_loss / len(y)


def clients_per_round(client_fraction: float, num_clients: int) -> int:
    """ceil(p K), ignoring floating-point error in p K (0.28 * 25 is 7.000000000000001, not above 7)."""
    return max(1, math.ceil(round(client_fraction * num_clients, 9)))


def select_clients(seed: int, round_index: int, num_clients: int, client_fraction: float) -> list[int]:
    """The clients taking part in a round: ceil(p K) of K, uniformly without replacement."""
    count = clients_per_round(client_fraction, num_clients)
    if count >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, Stream.SELECT, round_index).choice(num_clients, size=count, replace=False)
    return sorted(int(k) for k in chosen)


def _ledger_upto(stored: dict[str, Any], done: int) -> PrivacyLedger:
    """The stored ledger as of the last committed round.

    manifest.json is written last in a round, so an interruption just before
    it leaves privacy.json one round ahead of the manifest; that round is
    re-run on resume and must not be charged twice.
    """
    ledger = PrivacyLedger.from_dict(stored)
    if ledger.rounds <= done:
        return ledger
    lists = [[SGMEvent.from_dict(e) for e in events] for events in stored["history"]["event_lists"]]
    replay = PrivacyLedger(
        accountant=stored["accountant"],
        delta=stored["delta"],
        noise_multiplier=stored["noise_multiplier"],
        max_grad_norm=stored["max_grad_norm"],
    )
    for row in stored["history"]["rounds"][:done]:
        replay.record_round({int(k): lists[i] for k, i in row.items()})
    return replay


def _new_ledger(config: RunConfig) -> PrivacyLedger:
    return PrivacyLedger(
        accountant=config.privacy.accountant,
        delta=config.privacy.delta,
        noise_multiplier=config.privacy.noise_multiplier,
        max_grad_norm=config.privacy.max_grad_norm,
    )


def _manifest(setup: Setup, *, status: str, rounds_done: int, created: str) -> dict[str, Any]:
    config = setup.config
    model = build_model(setup.spec)
    return {
        "status": status,
        "rounds_done": rounds_done,
        "rounds": config.federated.rounds,
        "created": created,
        "algorithm": config.federated.algorithm,
        "dp": config.privacy.dp,
        "engine": config.engine,
        "device": str(setup.device),
        "versions": versions(),
        "dataset": {
            "name": setup.dataset.name,
            "source": setup.dataset.source,
            "fingerprint": setup.dataset.fingerprint,
            "train_size": int(len(setup.dataset.train_y)),
            "test_size": int(len(setup.dataset.test_y)),
        },
        "model": {
            "arch": setup.spec.arch,
            "input_shape": list(setup.spec.input_shape),
            "num_classes": setup.spec.num_classes,
            "width": setup.spec.width,
            "depth": setup.spec.depth,
            "num_parameters": num_parameters(model),
        },
        "clients": {
            "num_examples": [int(len(idx)) for idx in setup.partition.clients],
            "holdout": int(len(setup.partition.holdout)),
            "client_fraction_effective": setup.client_fraction,
            "dp_queries_per_round": [setup.queries[k] for k in range(len(setup.partition.clients))],
        },
    }


def _round_privacy_events(setup: Setup, messages: list, selected: list[int]) -> dict[int, list[SGMEvent]]:
    """Per client, this round's SGM events: the worst case of the plan and of what clients reported.

    Every client is charged every round (q1 = p q covers the chance of being
    selected), with T = max(planned worst case, queries actually made).
    """
    priv = setup.config.privacy
    reported = {m.client_id: m.privacy_events for m in messages}
    events: dict[int, list[SGMEvent]] = {}
    for k, q in setup.sample_rates.items():
        made = reported.get(k, [])
        steps = max(setup.queries[k], sum(e.steps for e in made))
        rate = max([q, *(e.sample_rate for e in made)])
        sigma = min([priv.noise_multiplier, *(e.noise_multiplier for e in made)])
        events[k] = round_events(
            noise_multiplier=sigma, sample_rate=rate, queries_per_round=steps, client_fraction=setup.client_fraction
        )
    return events


def _run_rounds(
    setup: Setup,
    run: RunDirectory,
    manifest: dict[str, Any],
    params: TensorDict,
    ledger: PrivacyLedger | None,
    rows: list[dict[str, Any]],
    states: dict[int, TensorDict],
    *,
    start: int,
    progress: bool,
    echo: Echo,
) -> TrainResult:
    config, device = setup.config, setup.device
    repeatable(device)
    rounds = config.federated.rounds
    dataset = setup.dataset
    clients = [
        ClientData(
            k,
            dataset.train_x[torch.from_numpy(idx.copy())].to(device),
            dataset.train_y[torch.from_numpy(idx.copy())].to(device),
        )
        for k, idx in enumerate(setup.partition.clients)
    ]
    test_x, test_y = dataset.test_x.to(device), dataset.test_y.to(device)
    model = build_model(setup.spec).to(device)
    params = {name: p.to(device) for name, p in params.items()}
    accuracy = float(rows[-1]["test_accuracy"]) if rows else float("nan")
    with make_engine(config, num_clients=len(clients), progress=progress, echo=echo) as engine:
        try:
            for m in tqdm(
                range(start, rounds), desc="rounds", unit="round", initial=start, total=rounds, disable=not progress
            ):
                began = time.perf_counter()
                ctx = RoundContext(round=m, rounds=rounds, config=config, device=device)
                selected = select_clients(config.seed, m, len(clients), config.federated.client_fraction)
                messages = engine.run_clients(
                    setup.algorithm,
                    model,
                    params,
                    [clients[k] for k in selected],
                    ctx,
                    lambda k: make_generator(config.seed, Stream.CLIENT, m, k, device=device),
                    states,
                )
                states.update({msg.client_id: msg.state for msg in messages if msg.state})
                result = setup.algorithm.server_update(
                    model, params, messages, ctx, make_generator(config.seed, Stream.SERVER, m, device=device)
                )
                params = clone_params(result.params)
                wall = time.perf_counter() - began
                epsilon = float("inf")
                if ledger is not None:
                    epsilon = ledger.record_round(_round_privacy_events(setup, messages, selected))
                accuracy, loss = evaluate(model, params, test_x, test_y)
                rows.append(
                    {
                        "round": m + 1,
                        "test_accuracy": accuracy,
                        "test_loss": loss,
                        "epsilon": epsilon,
                        "wall_seconds": wall,
                        "bytes_up": sum(msg.nbytes for msg in messages),
                        "clients": len(messages),
                        **{key: value for key, value in result.metrics.items() if isinstance(value, (int, float))},
                    }
                )
                run.save_checkpoint(
                    m + 1,
                    params,
                    {
                        **_checkpoint_state(config.seed, m + 1),
                        "clients": [
                            {"client": msg.client_id, "bytes_up": msg.nbytes, **msg.metrics} for msg in messages
                        ],
                        "server": {
                            key: value for key, value in result.metrics.items() if isinstance(value, (int, float))
                        },
                    },
                )
                if states:
                    run.save_client_states(m + 1, states)
                if config.save_transmitted:
                    for msg in messages:
                        run.save_transmitted(m + 1, msg.client_id, msg.payload)
                run.save_model(params, {"round": str(m + 1), "algorithm": config.federated.algorithm})
                run.write_metrics(rows)
                if ledger is not None:
                    run.write_privacy(ledger.to_dict())
                manifest.update(rounds_done=m + 1, status="complete" if m + 1 == rounds else "running")
                run.write_manifest(manifest)
                eps_text = f"epsilon {epsilon:.3f}" if ledger is not None else "no DP"
                echo(
                    f"round {m + 1}/{rounds}: test accuracy {accuracy:.4f}, loss {loss:.4f}, {eps_text}, "
                    f"{wall:.1f}s, {rows[-1]['bytes_up'] / 1e6:.2f} MB up"
                )
        except KeyboardInterrupt:
            manifest.update(status="interrupted")
            run.write_manifest(manifest)
            raise
        except BaseException:
            manifest.update(status="failed")
            run.write_manifest(manifest)
            raise
    if start == rounds:
        manifest.update(status="complete")
        run.write_manifest(manifest)
    return TrainResult(
        run_dir=run.path,
        rounds_done=rounds,
        test_accuracy=accuracy,
        epsilon=ledger.epsilon if ledger is not None else float("inf"),
    )


def _checkpoint_state(seed: int, round_number: int) -> dict[str, Any]:
    """What a resume needs besides the weights: the RNG streams are derived from (seed, stream, round, client)."""
    return {
        "round": round_number,
        "seed": seed,
        "rng": "derived per (seed, stream, round, client); see fedaudit.seeding",
        "torch_cpu_rng_state": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
        "python": sys.version.split()[0],
    }

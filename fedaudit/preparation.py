"""Setting up a run: resolve and check its configuration, load its data and partition, build its algorithm, and
work out its DP sampling rates, query counts and noise, all before anything is written.

Training, both engines, the study pipeline and (through :func:`resolve_device`) the attacks use this one module, so a
run is set up the same way wherever it is trained and re-checked the same way when it is resumed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from fedaudit.algorithms.base import Algorithm, ClientData, get_algorithm, setup_rounds
from fedaudit.config import RunConfig, accountant_delta, mark_calibrated, option_field
from fedaudit.data import Dataset, Partition, load_dataset, partition_dataset
from fedaudit.data.sites import SiteReport, federation, is_sites, load_sites
from fedaudit.errors import UserError
from fedaudit.instruments.canaries import GRADIENT_CANARY_NORM, Canaries, canary_directions, layout_for
from fedaudit.instruments.queries import query_audit
from fedaudit.models import ModelSpec, build_model, default_depth
from fedaudit.privacy.accounting import (
    AccountingError,
    calibrate_events,
    calibrate_noise_multiplier,
    update_noise_multiplier,
)
from fedaudit.registry import ALGORITHMS, option_readers
from fedaudit.seeding import Stream, numpy_rng


class TrainingError(UserError):
    """A run that cannot be set up as configured (one clear sentence)."""


def refuse_unread(given: Iterable[str], algorithm: str) -> None:
    """An option given (on the command line, or to :func:`fedaudit.train`) that only other algorithms read (FedLAP's,
    FedProx's mu) would be ignored without a word: it is refused, naming the algorithms that read it."""
    for name in sorted(set(given)):
        try:
            readers = option_readers(option_field(name))
        except KeyError:  # not a configuration field (--out, --resume, ...)
            continue
        if readers and algorithm not in readers:
            raise TrainingError(
                f"--{name.replace('_', '-')} is read by --algorithm {' or '.join(readers)} only, and this run is "
                f"{algorithm}: drop it or choose one of those."
            )


@dataclass
class Setup:
    """Everything a run needs, validated before any file is written."""

    config: RunConfig
    dataset: Dataset
    partition: Partition
    spec: ModelSpec
    device: torch.device
    algorithm: Algorithm
    client_fraction: float  # effective selection probability ceil(p K) / K (client-level DP: q, sampled by Poisson)
    queries: dict[int, int]  # worst-case DP queries per round, per client
    sample_rates: dict[int, float]  # B / N_k per client (DP only)
    canaries: Canaries | None = None  # planted for a canary audit (--canaries)
    sites: tuple[SiteReport, ...] = ()  # --dataset sites: what each site reported of its records (client order)

    @property
    def records_at_sites(self) -> bool:
        """Whether the clients' records are at their sites only (a deployment whose sites keep them): this process
        then never holds a record, and the sites train and evaluate on their own."""
        return bool(self.sites) and len(self.dataset.train_y) == 0

    def membership_arrays(self) -> dict[str, np.ndarray]:
        """What membership.npz holds: the partition's indices and, for sites that keep their records, each site's
        number of training records (``site_records``: site k's record p is index sum of the sites before it + p) and
        the hashes of each client's members and held-out records (``member_hashes_K``, ``heldout_hashes_K``)."""
        arrays = dict(self.partition.to_arrays())
        if self.sites:
            arrays["site_records"] = np.array([report.records for report in self.sites], dtype=np.int64)
        for report in self.sites:
            arrays[f"member_hashes_{report.client}"] = report.member_hashes
            arrays[f"heldout_hashes_{report.client}"] = report.heldout_hashes
        return arrays


def engine_unavailable(name: str, *, deployment: bool = False) -> str | None:
    """None when the engine ``name`` can run here, else one sentence saying what to install (an import probe: the
    engines themselves depend on this module, not the other way round). A Flower deployment needs Flower only; its
    simulation runtime needs Ray as well."""
    if name != "flower":
        return None
    if deployment:
        try:
            import flwr.superlink.grid  # noqa: F401
        except ImportError:
            return "--engine flower --superlink needs Flower: install it with pip install 'fedaudit[flower]'."
        return None
    try:
        import flwr.simulation  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        return "--engine flower needs Flower and Ray: install them with pip install 'fedaudit[flower]'."
    return None


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without one is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("--device cuda was requested but no CUDA device is available; use --device cpu or auto.")
    return torch.device(name)


def prepare(
    config: RunConfig,
    *,
    device: str | None = None,
    dataset: Dataset | None = None,
    sites: list[SiteReport] | None = None,
) -> Setup:
    """Resolve and check a configuration, load the data and build the partition; writes nothing.

    ``dataset`` replaces the configured dataset's records (reference models of an attack train the run's recipe on
    population records this way). ``sites`` are the reports of a deployment's sites that keep their records: the
    setup then holds none of them (see :func:`fedaudit.data.sites.federation`).
    """
    config = config.resolved()
    client_level = config.privacy.client_level
    missing = engine_unavailable(config.engine, deployment=config.flower.superlink is not None)
    if missing:
        raise TrainingError(missing)
    dataset, partition, reports = run_data(config, dataset, sites)
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
    sizes = {k: int(len(idx)) for k, idx in enumerate(partition.clients)}
    settings = ALGORITHMS[config.federated.algorithm].settings_module()
    if settings is not None and hasattr(settings, "for_clients"):  # what the algorithm sets from the clients' sizes
        section = settings.for_clients(getattr(config, settings.SECTION), config, sizes)
        config = replace(config, **{settings.SECTION: section})
    algorithm = get_algorithm(config)
    selected = clients_per_round(config.federated.client_fraction, config.data.num_clients)
    # at client level the server samples each client with probability q (Poisson), so q is the rate itself
    client_fraction = config.federated.client_fraction if client_level else selected / config.data.num_clients
    queries = {k: algorithm.queries_per_round(config, n) for k, n in sizes.items()}
    sample_rates: dict[int, float] = {}
    if client_level and config.privacy.noise_multiplier is None:
        config = mark_calibrated(config, _calibrated_client_sigma(config))
    if client_level and config.privacy.clipping == "adaptive":
        _check_adaptive_clipping(config)
    if config.privacy.record_level:
        batch = config.federated.batch_size
        smallest = min(sizes.values())
        if batch > smallest:
            raise TrainingError(
                f"--batch-size {batch} exceeds the smallest client's {smallest} records, so the DP sampling rate "
                f"B / N_k would exceed 1; use a batch size of at most {smallest}."
            )
        sample_rates = {k: batch / n for k, n in sizes.items()}
        if config.privacy.noise_multiplier is None:
            config = mark_calibrated(config, _calibrated_sigma(config, algorithm, sizes, sample_rates, queries))
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
        canaries=_canaries(config, dataset, partition, spec) if config.audit.canaries else None,
        sites=tuple(reports),
    )


def run_data(
    config: RunConfig, dataset: Dataset | None = None, sites: list[SiteReport] | None = None
) -> tuple[Dataset, Partition, list[SiteReport]]:
    """The run's records and partition: the configured dataset split from the seed, or, for ``--dataset sites``, the
    sites' own files, each read as its site reads it, with the sites' reports (``sites``: a deployment's, whose
    records stay at the sites). ``dataset`` replaces the configured records."""
    data = config.data
    if dataset is None and is_sites(data.dataset):
        if sites is not None:
            if len(sites) != data.num_clients:
                raise TrainingError(f"{len(sites)} sites reported for --num-clients {data.num_clients}.")
            shell, partition = federation(sites)
            return shell, partition, sites
        if not data.sites:
            raise TrainingError(
                "The records of this --dataset sites run are at its sites, not here: train it on a Flower deployment "
                "(--superlink), or give each client's data with --site-data."
            )
        return load_sites(
            data.sites,
            seed=config.seed,
            holdout_fraction=data.holdout_fraction,
            label_column=data.label_column,
            image_size=data.image_size,
        )
    if dataset is None:
        dataset = load_dataset(
            data.dataset,
            data.data_dir,
            download=data.download,
            label_column=data.label_column,
            image_size=data.image_size,
        )
    return dataset, _partition(config, dataset), []


def _canaries(config: RunConfig, dataset: Dataset, partition: Partition, spec: ModelSpec) -> Canaries:
    """The run's canaries; input canaries are held-out records, so there must be enough of them. Gradient canaries
    lie in parts of the model where there are enough of them (:func:`fedaudit.instruments.canaries.layout_for`)."""
    count, kind = config.audit.canaries, config.audit.canary_kind
    if kind == "input" and count > partition.holdout.size:
        raise TrainingError(
            f"--canaries {count} input canaries need as many held-out records, but this run holds out "
            f"{partition.holdout.size}; use fewer canaries or a larger --holdout-fraction."
        )
    if kind != "input":
        names = [name for name, p in build_model(spec).named_parameters() if p.requires_grad]
        return Canaries.draw(
            count=count,
            kind=kind,
            seed=config.seed,
            num_clients=config.data.num_clients,
            layout=layout_for(count, names),
        )
    labels = dataset.train_y.numpy()
    return Canaries.draw(
        count=count,
        kind=kind,
        seed=config.seed,
        num_clients=config.data.num_clients,
        holdout=partition.holdout,
        labels=labels,
        client_classes=[np.unique(labels[c]) for c in partition.clients],
    )


def client_data(setup: Setup, client: int, records: tuple[torch.Tensor, torch.Tensor] | None = None) -> ClientData:
    """Client ``client``'s records on the run's device, with the canaries it holds, if any: gradient canaries as
    their per-example gradients (10 C u_i, which clipping scales to C u_i), input canaries as records with their
    replaced labels. ``records`` are the client's own (inputs, labels) where the setup holds none (at a site that
    keeps them), else they are taken from the setup's dataset."""
    dataset, device = setup.dataset, setup.device
    if records is None:
        index = torch.from_numpy(setup.partition.clients[client].copy())
        records = dataset.train_x[index], dataset.train_y[index]
    data = ClientData(client, records[0].to(device), records[1].to(device))
    canaries = setup.canaries
    if canaries is None:
        return data
    shapes = {name: p.shape for name, p in build_model(setup.spec).named_parameters() if p.requires_grad}
    fed = setup.config.federated
    inputs = labels = None
    if canaries.kind == "input":
        inputs = dataset.train_x[torch.from_numpy(canaries.record)].to(device)
        labels = torch.from_numpy(canaries.label).to(dataset.train_y.dtype).to(device)
    data = replace(
        data,
        audit=query_audit(
            seed=setup.config.seed,
            canary_client=canaries.client,
            canary_included=canaries.included,
            client=client,
            kind=canaries.kind,
            shapes=shapes,
            clients=setup.config.data.num_clients,
            rounds=fed.rounds,
            client_fraction=setup.client_fraction,
            planned_queries=setup.queries[client],
            canary_inputs=inputs,
            canary_labels=labels,
            keep_whole=not is_sites(setup.config.data.dataset),
            kept_queries=setup.config.audit.kept_queries,
            layout=canaries.layout,
        ),
    )
    held = canaries.held_by(client)
    if not len(held):
        return data
    if canaries.kind == "input":
        records = torch.from_numpy(canaries.record[held])
        labels = torch.from_numpy(canaries.label[held]).to(dataset.train_y.dtype)
        return replace(data, canary_x=dataset.train_x[records].to(device), canary_y=labels.to(device))
    directions = canary_directions(setup.config.seed, held, shapes, device, canaries.layout)
    norm = GRADIENT_CANARY_NORM * setup.config.privacy.max_grad_norm
    return replace(data, canary_grads={name: norm * u for name, u in directions.items()})


@dataclass(frozen=True)
class DataAccess:
    """How many DP queries (local steps) a client makes per round in the worst case, and the DP-FedAvg settings that
    match it: the fair comparison of FedLAP-DP with its gradient-sharing baselines (docs/algorithms.md)."""

    algorithm: str
    queries: int  # worst-case DP queries per client per round
    batch_size: int
    smallest_client: int  # records of the smallest client
    largest_client: int  # records of the largest client

    @property
    def batches(self) -> tuple[int, int]:
        """Batches per epoch, floor(N_k / B) (at least 1), of the smallest and of the largest client."""
        few, many = (max(1, n // self.batch_size) for n in (self.smallest_client, self.largest_client))
        return few, many

    @property
    def local_epochs(self) -> int:
        """The whole number of local epochs whose queries come nearest to :attr:`queries` for the client that makes
        the most (the largest)."""
        return max(1, round(self.queries / self.batches[1]))

    def lines(self) -> list[str]:
        """What ``fedaudit train --equal-data-access`` prints: a range where the clients differ in size."""
        epochs, (few, many) = self.local_epochs, self.batches
        records = _span(self.smallest_client, self.largest_client)
        return [
            f"{self.algorithm} makes at most {self.queries} DP queries per client per round (batch {self.batch_size}; "
            f"clients of {records} records, {_span(few, many)} batches per epoch).",
            f"DP-FedAvg at equal data access: --algorithm fedavg --local-steps {self.queries} "
            f"(nearest whole epochs: --local-epochs {epochs} = {_span(epochs * few, epochs * many)} queries).",
        ]


def _span(low: int, high: int) -> str:
    """``low`` where it equals ``high``, else "low to high"."""
    return str(low) if low == high else f"{low} to {high}"


def data_access(config: RunConfig, *, algorithm: str | None = None) -> DataAccess:
    """The worst-case DP queries per client per round of ``config``, run as ``algorithm`` when given (its other
    settings kept; ``local_steps`` is dropped so that the algorithm's own count applies)."""
    if algorithm is not None and algorithm != config.federated.algorithm:
        config = replace(config, federated=replace(config.federated, algorithm=algorithm, local_steps=None))
    config = config.resolved()
    _, partition, _ = run_data(config)
    sizes = [len(idx) for idx in partition.clients]
    built = get_algorithm(config)
    queries = max(built.queries_per_round(config, n) for n in sizes)
    return DataAccess(config.federated.algorithm, queries, config.federated.batch_size, min(sizes), max(sizes))


def _check_adaptive_clipping(config: RunConfig) -> None:
    """Adaptive clipping's count noise: within the fraction's range, and leaving noise for the updates' sum."""
    expected = config.federated.client_fraction * config.data.num_clients
    count_noise = config.privacy.count_noise_for(expected)
    if count_noise > expected:
        raise TrainingError(
            f"--count-noise {count_noise:g} over the {expected:g} clients a round is expected to hold gives the "
            f"fraction of updates under C noise of standard deviation {count_noise / expected:.3g}, more than the "
            f"fraction's whole range, so C would follow the noise; use at most {expected:g} (Andrew et al. use "
            f"{expected / 20:g})."
        )
    try:
        update_noise_multiplier(config.privacy.noise_multiplier, count_noise)
    except AccountingError as exc:
        raise TrainingError(str(exc)) from None


def _partition(config: RunConfig, dataset: Dataset) -> Partition:
    """The run's clients and held-out pool, drawn from its seed."""
    return partition_dataset(
        dataset.train_y.numpy(),
        num_clients=config.data.num_clients,
        scheme=config.data.partition,
        seed=config.seed,
        holdout_fraction=config.data.holdout_fraction,
    )


def _calibrated_sigma(
    config: RunConfig,
    algorithm: Algorithm,
    sizes: dict[int, int],
    sample_rates: dict[int, float],
    queries: dict[int, int],
) -> float:
    """The noise multiplier that meets ``--target-epsilon`` for every client over the rounds it takes part in: from
    the algorithm's own privacy plan where it has one, else from its B / N_k steps."""
    taking_part = participation(config, algorithm)
    if hasattr(algorithm, "privacy_plan"):
        return max(_calibrate_plan(config, algorithm, sizes[k], rounds) for k, rounds in taking_part.items() if rounds)
    return max(
        calibrate_noise_multiplier(
            target_epsilon=config.privacy.target_epsilon,
            sample_rate=q,
            queries_per_round=queries[k],
            rounds=len(taking_part[k]),
            delta=config.privacy.delta,
            accountant=config.privacy.accountant,
        )
        for k, q in sample_rates.items()
        if taking_part[k]
    )


def _calibrated_client_sigma(config: RunConfig) -> float:
    """The noise multiplier that meets ``--target-epsilon`` at client level: one Sampled Gaussian Mechanism per
    round, at the server's client sampling rate q."""
    priv = config.privacy
    return calibrate_noise_multiplier(
        target_epsilon=priv.target_epsilon,
        sample_rate=config.federated.client_fraction,
        queries_per_round=1,
        rounds=config.federated.rounds,
        delta=accountant_delta(config),
        accountant=priv.accountant,
    )


def _calibrate_plan(config: RunConfig, algorithm: Algorithm, num_examples: int, rounds: list[int]) -> float:
    """The noise multiplier that meets ``--target-epsilon`` over the ``rounds`` a client takes part in, for an
    algorithm that plans its events itself."""
    priv = config.privacy

    def events_at(sigma: float) -> list:
        at = replace(config, privacy=replace(priv, noise_multiplier=sigma))
        return [event for m in rounds for event in algorithm.privacy_plan(at, num_examples, m)]

    return calibrate_events(events_at, target_epsilon=priv.target_epsilon, delta=priv.delta, accountant=priv.accountant)


def clients_per_round(client_fraction: float, num_clients: int) -> int:
    """ceil(p K), ignoring floating-point error in p K (0.28 * 25 is 7.000000000000001, not above 7)."""
    return max(1, math.ceil(round(client_fraction * num_clients, 9)))


def round_participants(config: RunConfig, algorithm: Algorithm, round_index: int) -> list[int]:
    """The clients taking part in round ``round_index``: all of them in an algorithm's set-up rounds, else
    ``--client-fraction`` of them. The choice depends on the seed alone, never on data."""
    fraction = 1.0 if round_index < setup_rounds(algorithm) else config.federated.client_fraction
    return select_clients(config.seed, round_index, config.data.num_clients, fraction)


def participation(config: RunConfig, algorithm: Algorithm) -> dict[int, list[int]]:
    """Per client, the rounds it takes part in: what the ledger will charge, known before training because the
    selection depends on the seed alone (calibration meets the target for exactly these rounds)."""
    rounds: dict[int, list[int]] = {k: [] for k in range(config.data.num_clients)}
    for m in range(config.federated.rounds):
        for k in round_participants(config, algorithm, m):
            rounds[k].append(m)
    return rounds


def select_clients(seed: int, round_index: int, num_clients: int, client_fraction: float) -> list[int]:
    """The clients taking part in a round: ceil(p K) of K, uniformly without replacement."""
    count = clients_per_round(client_fraction, num_clients)
    if count >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, Stream.SELECT, round_index).choice(num_clients, size=count, replace=False)
    return sorted(int(k) for k in chosen)

"""Reference models for RMIA and LiRA: the target run's own recipe, retrained on population records, cached in the run.

A reference model is a federated run through the same training core as the target: the same algorithm, model,
rounds, DP settings, number of clients and partition scheme, on other records. Its records come from the pool:
every record of the dataset (both splits) that the attack does not audit.

- Offline (the default): reference k trains on as many pool records as the target trained on (at most half the
  pool), drawn from its own seed, so the audited records are never seen by any reference, and the first K references
  of a larger set are the K references of a smaller one.
- Online (``--online``): the audited records join the pool (with as many others as make it twice the target's
  size) and every pool record is in exactly half of the K references (K even), so that each audited record has K/2
  references with it and K/2 without.

References are cached under ``references/`` in the run directory (``ref-NNN.safetensors``, ``inclusion.npz`` with
the pool and the inclusion matrix, and ``references.json``, written last, with what they were trained for). A
second attack with the same run, audited records and mode reuses them; anything else retrains them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from fedaudit.attacks import AttackError, Draw
from fedaudit.attacks.membership.evaluation import EvaluationSet
from fedaudit.attacks.membership.methods import MethodOutput
from fedaudit.attacks.membership.reference_attacks import lira_scores, rmia_scores, tune_a
from fedaudit.attacks.membership.signals import OUTPUT_SIGNALS, Signals, compute_signals, oriented
from fedaudit.attacks.options import MAX_REFERENCES
from fedaudit.config import MAX_SEED, AuditConfig, RunConfig
from fedaudit.data import Dataset
from fedaudit.data.partition import PartitionError
from fedaudit.errors import UserError
from fedaudit.models import ModelSpec, build_model
from fedaudit.preparation import prepare
from fedaudit.rundir import RunDirectory, atomic_write_json, load_tensors, read_arrays, save_tensors, write_arrays
from fedaudit.seeding import Stream, numpy_rng
from fedaudit.training import train_setup

FORMAT_VERSION = 1


@dataclass(frozen=True, eq=False)
class Pool:
    """Records the references may train on, as (split, index) pairs; the first ``audited`` are the audited records
    (online mode only)."""

    source: np.ndarray  # "train" or "test"
    index: np.ndarray
    audited: int = 0

    def __len__(self) -> int:
        return int(self.index.size)

    def records(self, dataset: Dataset, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and labels of the pool rows ``rows``."""
        source, index = self.source[rows], torch.from_numpy(self.index[rows])
        train = torch.from_numpy(source == "train")
        x = torch.empty((len(rows), *dataset.train_x.shape[1:]), dtype=dataset.train_x.dtype)
        y = torch.empty(len(rows), dtype=torch.int64)
        x[train], y[train] = dataset.train_x[index[train]], dataset.train_y[index[train]]
        x[~train], y[~train] = dataset.test_x[index[~train]], dataset.test_y[index[~train]]
        return x, y

    def digest(self) -> str:
        data = np.char.add(np.char.add(self.source.astype(str), ":"), self.index.astype(str))
        return hashlib.sha256("\n".join(data.tolist()).encode()).hexdigest()


def reference_pool(
    dataset: Dataset, evaluation: EvaluationSet, *, online: bool, train_size: int | None = None, seed: int = 0
) -> Pool:
    """Every record of both splits that is not audited; online, the audited records first, followed by as many
    others (drawn from ``seed``) as make the pool twice ``train_size``, so that a reference trained on half of it
    has the target's size."""
    parts = []
    for split, size in (("train", len(dataset.train_y)), ("test", len(dataset.test_y))):
        free = np.ones(size, dtype=bool)
        free[evaluation.index[evaluation.source == split]] = False
        parts.append((np.full(int(free.sum()), split), np.flatnonzero(free)))
    source = np.concatenate([s for s, _ in parts])
    index = np.concatenate([i for _, i in parts]).astype(np.int64)
    if not online:
        return Pool(source, index)
    if train_size is not None:
        keep = max(0, min(index.size, 2 * train_size - len(evaluation)))
        chosen = np.sort(np.random.default_rng(reference_seeds(seed)[-1]).permutation(index.size)[:keep])
        source, index = source[chosen], index[chosen]
    return Pool(
        np.concatenate([evaluation.source.astype(str), source]),
        np.concatenate([evaluation.index.astype(np.int64), index]),
        audited=len(evaluation),
    )


def reference_seeds(seed: int) -> np.ndarray:
    """The seeds of references 0..MAX_REFERENCES-1 (their records and their training), from the attack's seed."""
    return numpy_rng(seed, Stream.ATTACK, Draw.REFERENCES).integers(0, MAX_SEED, size=MAX_REFERENCES)


def inclusion_matrix(
    pool_size: int, count: int, *, online: bool, seed: int, train_size: int | None = None
) -> np.ndarray:
    """[count, pool_size] bool: offline, each reference min(``train_size``, half the pool) records drawn from its
    own seed; online, each record in exactly count / 2 references."""
    seeds = reference_seeds(seed)
    if online:
        ranks = np.argsort(np.random.default_rng(seeds[0]).random((count, pool_size)), axis=0)
        return ranks < count // 2
    size = pool_size // 2 if train_size is None else min(train_size, pool_size // 2)
    rows = np.zeros((count, pool_size), dtype=bool)
    for k in range(count):
        rows[k, np.random.default_rng(seeds[k]).permutation(pool_size)[:size]] = True
    return rows


@dataclass(frozen=True, eq=False)
class References:
    """K trained reference models (their parameters) and which pool records each trained on."""

    pool: Pool
    included: np.ndarray  # [K, len(pool)] bool
    params: list[dict[str, torch.Tensor]]
    online: bool
    trained: int  # how many were trained by this call (the rest came from the cache)

    @property
    def count(self) -> int:
        return len(self.params)


def _cache_key(run: RunDirectory, pool: Pool, seed: int, online: bool) -> dict:
    """What the references depend on: the run (its data, recipe, rounds and final weights), the pool and the seed."""
    manifest = run.read_manifest()
    recipe = {  # without the settings that change how a run is carried out, never its results
        key: value for key, value in run.read_config().items() if key not in ("parallel_clients", "flower")
    }
    return {
        "format_version": FORMAT_VERSION,
        "dataset_fingerprint": manifest.dataset.fingerprint,
        "rounds": manifest.rounds_done,
        "config": hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest(),
        "model": hashlib.sha256(run.model_path.read_bytes()).hexdigest(),
        "pool": pool.digest(),
        "seed": seed,
        "mode": "online" if online else "offline",
    }


def _reference_dataset(dataset: Dataset, pool: Pool, rows: np.ndarray) -> Dataset:
    x, y = pool.records(dataset, rows)
    return Dataset(
        name=dataset.name,
        train_x=x,
        train_y=y,
        test_x=dataset.test_x,
        test_y=dataset.test_y,
        num_classes=dataset.num_classes,
        source=f"{len(rows)} population records of {dataset.name}",
        fingerprint=hashlib.sha256(
            f"{dataset.fingerprint}:{pool.digest()}:{rows.tobytes().hex()}".encode()
        ).hexdigest(),
    )


def train_reference(
    config: RunConfig,
    dataset: Dataset,
    pool: Pool,
    rows: np.ndarray,
    *,
    seed: int,
    rounds: int,
    device: str,
    work: Path,
) -> dict[str, torch.Tensor]:
    """One reference: the target's recipe (``config``) on the pool rows ``rows``, through the training core."""
    recipe = replace(
        config,
        seed=int(seed),
        device=device,
        save_transmitted=False,
        audit=AuditConfig(),
        data=replace(config.data, holdout_fraction=0.0),
        federated=replace(config.federated, rounds=rounds),
    )
    if recipe.dp_randomness:  # the auditor's own models: their noise is reproducible from the attack's seed
        recipe = replace(recipe, privacy=replace(recipe.privacy, noise_seed=int(seed)))
    try:
        setup = prepare(recipe, dataset=_reference_dataset(dataset, pool, rows))
        train_setup(setup, work, overwrite=True, progress=False, echo=lambda _line: None)
    except UserError as exc:
        shutil.rmtree(work, ignore_errors=True)
        why = (  # the partition's own advice (fewer clients, another scheme) is for the run, not for its attacker
            f"split over the run's {config.data.num_clients} clients under {config.data.partition}, some client "
            "would get no record"
            if isinstance(exc, PartitionError)
            else str(exc).rstrip(".")
        )
        raise AttackError(
            f"A reference model cannot be trained on {len(rows)} population records with the run's recipe (each "
            f"trains on as many records as the run, at most half of those the attack does not audit; --max-records "
            f"audits fewer and leaves it more): {why}."
        ) from exc
    params = load_tensors(work / "model.safetensors")
    shutil.rmtree(work)
    return params


def references(
    run: RunDirectory,
    config: RunConfig,
    dataset: Dataset,
    evaluation: EvaluationSet,
    *,
    count: int,
    online: bool,
    seed: int,
    device: str,
    progress: bool = False,
    echo: Callable[[str], None] = print,
    population: int = 0,
) -> References:
    """K reference models for ``evaluation``, from the cache under references/ where it still fits, else trained.
    ``population``: the fewest records RMIA needs in the pool besides the audited ones (checked before training)."""
    if online and count % 2:
        raise AttackError(f"--online needs an even number of --references (each record in half), got {count}.")
    if not 1 <= count <= MAX_REFERENCES:
        raise AttackError(f"--references must be from 1 to {MAX_REFERENCES}, got {count}.")
    train_size = sum(int(n) for n in run.read_manifest().clients.num_examples)  # the target's records
    pool = reference_pool(dataset, evaluation, online=online, train_size=train_size, seed=seed)
    if len(pool) < 2 * config.data.num_clients:
        raise AttackError(
            f"{run.path} leaves {len(pool)} records outside the audited ones, too few for reference models of "
            f"{config.data.num_clients} clients; lower --max-records."
        )
    if len(pool) - pool.audited < population:
        raise AttackError(
            f"{run.path} leaves {len(pool) - pool.audited} records besides the audited ones in the online references' "
            f"pool, and RMIA compares each audited record with at least {population} such population records; "
            "lower --max-records."
        )
    included = inclusion_matrix(len(pool), count, online=online, seed=seed, train_size=train_size)
    folder = run.path / "references"
    key = _cache_key(run, pool, seed, online)
    cached = _read_cache(folder, key, included)
    seeds = reference_seeds(seed)
    rounds = run.read_manifest().rounds_done
    params = cached[:count]
    missing = range(len(params), count)
    if missing and not params:
        shutil.rmtree(folder, ignore_errors=True)
    for k in tqdm(missing, desc=f"{run.path.name} references", unit="model", disable=not progress):
        rows = np.flatnonzero(included[k])
        trained = train_reference(
            config, dataset, pool, rows, seed=seeds[k], rounds=rounds, device=device, work=folder / f".work-{k:03d}"
        )
        save_tensors(folder / f"ref-{k:03d}.safetensors", trained, {"reference": str(k)})
        params.append(trained)
    if missing:
        write_arrays(folder / "inclusion.npz", {"source": pool.source, "index": pool.index, "included": included})
        atomic_write_json(folder / "references.json", {**key, "count": count})
        echo(f"{run.path}: trained {len(missing)} reference model(s), {len(params)} in references/")
    return References(pool=pool, included=included, params=params, online=online, trained=len(missing))


def _read_cache(folder: Path, key: dict, included: np.ndarray) -> list[dict[str, torch.Tensor]]:
    """The cached references that fit ``key`` and the wanted inclusion rows, in order (none if anything differs)."""
    try:
        stored = json.loads((folder / "references.json").read_text())
        arrays = read_arrays(folder / "inclusion.npz")
    except (OSError, ValueError, UserError):
        return []
    if {k: stored.get(k) for k in key} != key:
        return []
    count = min(int(stored.get("count", 0)), len(included))
    old = arrays.get("included")
    if old is None or old.shape[1] != included.shape[1] or len(old) < count:
        return []
    if key["mode"] == "online" and len(old) != len(included):
        return []  # online inclusion depends on K: a different K is a different set of references
    if not np.array_equal(old[:count], included[:count]):
        return []
    params = []
    for k in range(count):
        path = folder / f"ref-{k:03d}.safetensors"
        if not path.is_file():
            break
        params.append(load_tensors(path))
    return params


MAX_POPULATION = 2000  # population records z that RMIA compares each audited record with
MIN_POPULATION = 50  # the fewest: its score is a fraction of them, in steps of 1 / their number
DEFAULT_A = 0.3  # RMIA's offline a when it cannot be tuned (one reference): the paper's value for CIFAR-10


def probability(signal: str, values: np.ndarray) -> np.ndarray:
    """p(y|x), the probability of the true label, from an output signal's values."""
    if signal == "loss":
        return np.exp(-values)
    if signal == "logit-confidence":
        return 1.0 / (1.0 + np.exp(-values))
    if signal == "confidence":
        return values
    raise ValueError(f"{signal} is not a signal of the model's output")


@dataclass(frozen=True, eq=False)
class ReferenceSignals:
    """The audited records' signals on every reference, and what RMIA compares them with."""

    values: dict[str, np.ndarray]  # signal -> [K, n] on the audited records
    x_in: np.ndarray | None  # [K, n] which references trained on each audited record (online), else None
    target_z: np.ndarray  # [m] p(z|target) of the population records
    refs_z: np.ndarray  # [K, m] p(z|reference)
    z_in: np.ndarray  # [K, m] which references trained on each population record
    a: float
    a_tuned: bool
    online: bool
    trained: int  # references trained by this attack (the others were cached)

    @property
    def count(self) -> int:
        return len(self.refs_z)

    def details(self) -> dict[str, Any]:
        """What every result of these references says about them."""
        return {
            "references": {
                "count": self.count,
                "mode": "online" if self.online else "offline",
                "trained_now": self.trained,
                # those compared: offline, a population record every reference trained on has no p(z)
                "population_records": int(self.refs_z.shape[1] if self.online else (~self.z_in).any(axis=0).sum()),
            }
        }


def lira_attack(compared: ReferenceSignals, signal: str, target: np.ndarray) -> MethodOutput:
    """LiRA scores of the audited records on ``signal`` (``target``: its values on the target model)."""
    details = compared.details()
    scores = lira_scores(oriented(signal, target), oriented(signal, compared.values[signal]), compared.x_in)
    details["references"]["model"] = "Gaussian, one variance for all records" + (
        "" if compared.online else ", one-sided (offline)"
    )
    return MethodOutput(scores=scores, audit=np.ones(scores.size, dtype=bool), details=details)


def rmia_attack(compared: ReferenceSignals, signal: str, target: np.ndarray) -> MethodOutput:
    """RMIA scores of the audited records on ``signal`` (``target``: its values on the target model)."""
    details = compared.details()
    scores = rmia_scores(
        probability(signal, target),
        probability(signal, compared.values[signal]),
        compared.target_z,
        compared.refs_z,
        a=compared.a,
        online=compared.online,
        z_out=~compared.z_in,
    )
    details["references"].update(a=None if compared.online else compared.a, a_tuned=compared.a_tuned, gamma=1.0)
    return MethodOutput(scores=scores, audit=np.ones(scores.size, dtype=bool), details=details)


def reference_signals(
    refs: References,
    *,
    spec: ModelSpec,
    target: nn.Module,
    dataset: Dataset,
    x: torch.Tensor,
    y: torch.Tensor,
    signals: Sequence[str],
    seed: int,
    batch_size: int,
    device: torch.device,
) -> ReferenceSignals:
    """Signals of the audited records (x, y) on every reference, and p(z) of up to MAX_POPULATION population
    records on the target and on every reference."""
    wanted = [s for s in signals if s in OUTPUT_SIGNALS or s == "grad-norm"]
    population = np.arange(refs.pool.audited, len(refs.pool))
    rng = numpy_rng(seed, Stream.ATTACK, Draw.POPULATION)
    z_rows = np.sort(rng.choice(population, size=min(MAX_POPULATION, population.size), replace=False))
    xz, yz = refs.pool.records(dataset, z_rows)

    def measure(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, names: Sequence[str]) -> Signals:
        return compute_signals(model, inputs, labels, names, batch_size=batch_size, device=device)

    target_z = np.exp(-measure(target, xz, yz, ["loss"]).values["loss"])
    values: dict[str, list[np.ndarray]] = {s: [] for s in wanted}
    refs_z = []
    model = build_model(spec).to(device)
    for params in refs.params:
        model.load_state_dict({name: t.to(device) for name, t in params.items()})
        model.eval()
        measured = measure(model, x, y, wanted)
        for s in wanted:
            values[s].append(measured.values[s])
        refs_z.append(np.exp(-measure(model, xz, yz, ["loss"]).values["loss"]))
    refs_z_array, z_in = np.stack(refs_z), refs.included[:, z_rows]
    tuned = None if refs.online else tune_a(refs_z_array, z_in)
    return ReferenceSignals(
        values={s: np.stack(v) for s, v in values.items()},
        x_in=refs.included[:, : refs.pool.audited] if refs.online else None,
        target_z=target_z,
        refs_z=refs_z_array,
        z_in=z_in,
        a=DEFAULT_A if tuned is None else tuned,
        a_tuned=tuned is not None,
        online=refs.online,
        trained=refs.trained,
    )

"""The run directory: the contract between train, attack and report.

Layout (every file and key: docs/run-directory.md)::

    config.json  manifest.json  membership.npz  metrics.csv  privacy.json  model.safetensors
    checkpoints/round-NNNN.safetensors (+ .json, -clients, -server, -server-kept .safetensors)  transmitted/  attacks/

Weights are safetensors and metadata JSON, so nothing is ever unpickled.
Every file is written to a temporary name in the same directory and renamed,
so a crash never leaves half a file; manifest.json is written last in a round
and is the commit point that ``--resume`` trusts.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from torch import nn

import fedaudit
from fedaudit import integrity
from fedaudit.config import ConfigError, RunConfig
from fedaudit.errors import UserError
from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy.randomness import RUN_SEED, SECRETS_FILE, SOURCES

if TYPE_CHECKING:
    from fedaudit.data import Dataset

RUN_FORMAT = "fedaudit-run"
FORMAT_VERSION = 1
METRIC_COLUMNS = ("round", "test_accuracy", "test_loss", "epsilon", "wall_seconds", "bytes_up")


class RunError(UserError):
    """A run directory that is missing, incomplete, or from an incompatible version (one clear sentence)."""


def _field(data: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``data[key]`` checked to be of ``kind`` (a bool is not an int here); a :class:`RunError` naming ``where``."""
    value = data.get(key) if isinstance(data, Mapping) else None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RunError(f'{where} has no valid "{key}" entry.')
    return value


def _ints(data: Mapping[str, Any], key: str, where: str) -> tuple[int, ...]:
    values = _field(data, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise RunError(f'{where} has no valid "{key}" entry (a list of integers).')
    return tuple(values)


@dataclass(frozen=True)
class DatasetRecord:
    """The data a run was trained on: a resume or an attack must find the same bytes (fingerprint)."""

    name: str
    source: str
    fingerprint: str
    train_size: int
    test_size: int

    @classmethod
    def from_dict(cls, data: Any, where: str) -> DatasetRecord:
        return cls(
            name=_field(data, "name", str, where),
            source=_field(data, "source", str, where),
            fingerprint=_field(data, "fingerprint", str, where),
            train_size=_field(data, "train_size", int, where),
            test_size=_field(data, "test_size", int, where),
        )


@dataclass(frozen=True)
class ModelRecord:
    """The global model's architecture, enough to rebuild it and fill it from safetensors (nothing unpickled)."""

    arch: str
    input_shape: tuple[int, int, int]
    num_classes: int
    width: int
    depth: int
    num_parameters: int

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.arch, self.input_shape, self.num_classes, self.width, self.depth)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "input_shape": list(self.input_shape)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ModelRecord:
        shape = _ints(data, "input_shape", where)
        if len(shape) != 3:
            raise RunError(f'{where} has no valid "input_shape" entry (three integers).')
        return cls(
            arch=_field(data, "arch", str, where),
            input_shape=(shape[0], shape[1], shape[2]),
            num_classes=_field(data, "num_classes", int, where),
            width=_field(data, "width", int, where),
            depth=_field(data, "depth", int, where),
            num_parameters=_field(data, "num_parameters", int, where),
        )


@dataclass(frozen=True)
class ClientsRecord:
    """The clients as the accountant saw them: sizes, held-out pool, effective participation, worst-case queries."""

    num_examples: tuple[int, ...]
    holdout: int
    client_fraction_effective: float
    dp_queries_per_round: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_examples": list(self.num_examples),
            "holdout": self.holdout,
            "client_fraction_effective": self.client_fraction_effective,
            "dp_queries_per_round": list(self.dp_queries_per_round),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> ClientsRecord:
        return cls(
            num_examples=_ints(data, "num_examples", where),
            holdout=_field(data, "holdout", int, where),
            client_fraction_effective=float(_field(data, "client_fraction_effective", (int, float), where)),
            dp_queries_per_round=_ints(data, "dp_queries_per_round", where),
        )


@dataclass(frozen=True)
class RandomnessRecord:
    """Where the run's clients drew their random choices from (:mod:`fedaudit.privacy.randomness`): each client's own
    secret (``client-secrets``), a public ``--noise-seed`` (``noise-seed``), or the run seed (``run-seed``: a run
    without DP randomness); and the run's public id, which client keys are bound to."""

    source: str
    run_id: str

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "run_id": self.run_id}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> RandomnessRecord:
        source = _field(data, "source", str, where)
        if source not in SOURCES:
            raise RunError(
                f"{where} has an unknown randomness source {source!r}; expected one of {', '.join(SOURCES)}."
            )
        run_id = _field(data, "run_id", str, where)
        if not re.fullmatch(r"[0-9a-f]{32}", run_id):
            raise RunError(f"{where} has a run id that is not 32 hex digits.")
        return cls(source=source, run_id=run_id)


MANIFEST_STATUSES = ("running", "complete", "interrupted", "failed")
# The largest JSON or CSV file of a run that fedaudit reads whole: a run of 100,000 rounds writes a metrics.csv of about
# 20 MB, and an attack's scores.csv on 70,000 records about 5 MB; a file beyond this was not written by fedaudit.
MAX_RUN_TEXT_BYTES = 256 << 20


def bounded_size(path: Path, limit: int | None = None) -> None:
    """A :class:`RunError` naming ``path`` and its size when it is larger than ``limit`` (:data:`MAX_RUN_TEXT_BYTES`
    by default; checked before it is read, so a file grown to gigabytes is one sentence rather than the machine's
    memory)."""
    limit = MAX_RUN_TEXT_BYTES if limit is None else limit
    size = path.stat().st_size
    if size > limit:
        raise RunError(
            f"{path} is {size / 2**20:,.1f} MiB, larger than any file fedaudit writes ({limit / 2**20:,.1f} MiB): it "
            "was changed after the run was written."
        )


# manifest.json's fields that change when attacks and verify add their results to a signed run: its file hashes and
# the time of its last write
_GROWS_AFTER_SIGNING = frozenset({"files", "pending", "updated"})


@dataclass(frozen=True)
class Manifest:
    """manifest.json: what the run is and how far it got. Written last in every round: the commit point of a round.

    Every reader (resume, attack, report, study) gets this type from :meth:`RunDirectory.read_manifest`, checked.
    """

    status: str
    rounds_done: int
    rounds: int
    created: str
    algorithm: str
    dp: bool
    engine: str
    device: str
    versions: Mapping[str, str]
    dataset: DatasetRecord
    model: ModelRecord
    clients: ClientsRecord
    updated: str | None = None
    # None: written before fedaudit kept client secrets, when every client's draws came from the run seed
    randomness: RandomnessRecord | None = None

    @property
    def randomness_source(self) -> str:
        """Where the clients' noise came from; runs written before client secrets drew it from the run seed."""
        return RUN_SEED if self.randomness is None else self.randomness.source

    def advanced(self, *, rounds_done: int | None = None, status: str | None = None) -> Manifest:
        """The same manifest after progress: more rounds done, or a new status."""
        return dataclasses.replace(
            self,
            rounds_done=self.rounds_done if rounds_done is None else rounds_done,
            status=self.status if status is None else status,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "rounds_done": self.rounds_done,
            "rounds": self.rounds,
            "created": self.created,
            "algorithm": self.algorithm,
            "dp": self.dp,
            "engine": self.engine,
            "device": self.device,
            "versions": dict(self.versions),
            "dataset": dataclasses.asdict(self.dataset),
            "model": self.model.to_dict(),
            "clients": self.clients.to_dict(),
            **({} if self.randomness is None else {"randomness": self.randomness.to_dict()}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Manifest:
        """Build and check; ``where`` names the file in the one-sentence :class:`RunError` of a bad entry."""
        status = _field(data, "status", str, where)
        if status not in MANIFEST_STATUSES:
            raise RunError(f"{where} has an unknown status {status!r}.")
        versions = _field(data, "versions", dict, where)
        return cls(
            status=status,
            rounds_done=_field(data, "rounds_done", int, where),
            rounds=_field(data, "rounds", int, where),
            created=_field(data, "created", str, where),
            algorithm=_field(data, "algorithm", str, where),
            dp=_field(data, "dp", bool, where),
            engine=_field(data, "engine", str, where),
            device=_field(data, "device", str, where),
            versions={str(k): str(v) for k, v in versions.items()},
            dataset=DatasetRecord.from_dict(_field(data, "dataset", dict, where), f"{where} (dataset)"),
            model=ModelRecord.from_dict(_field(data, "model", dict, where), f"{where} (model)"),
            clients=ClientsRecord.from_dict(_field(data, "clients", dict, where), f"{where} (clients)"),
            updated=data.get("updated") if isinstance(data.get("updated"), str) else None,
            randomness=None
            if data.get("randomness") is None
            else RandomnessRecord.from_dict(data["randomness"], f"{where} (randomness)"),
        )


def _number(value: Any) -> float | None:
    """A JSON number as a float; None for null, NaN, or anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)


def _interval(value: Any) -> tuple[float, float] | None:
    """A JSON interval [low, high]; None when absent or not two numbers."""
    if isinstance(value, list) and len(value) == 2:
        low, high = _number(value[0]), _number(value[1])
        if low is not None and high is not None:
            return low, high
    return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class RateRecord:
    """One entry of an attack's "tpr_at_fpr": the TPR at a target FPR with its interval and sample sizes.

    Results of attack format 1 stored a bare number; ``detailed`` is False for those.
    """

    tpr: float | None
    detailed: bool = True
    ci95: tuple[float, float] | None = None
    estimable: bool = True
    num_members: int | None = None
    num_nonmembers: int | None = None
    nonmembers_needed: int | None = None
    fpr: float | None = None
    fpr_ci95: tuple[float, float] | None = None
    reason: str | None = None  # why it is not estimable

    @classmethod
    def from_json(cls, value: Any) -> RateRecord | None:
        if isinstance(value, dict):
            needed = value.get("nonmembers_needed")
            if needed is not None and _count(needed) is None:
                raise RunError(f"nonmembers_needed must be an integer, got {needed!r}.")
            return cls(
                tpr=_number(value.get("tpr")),
                ci95=_interval(value.get("ci95")),
                estimable=bool(value.get("estimable", True)),
                num_members=_count(value.get("num_members")),
                num_nonmembers=_count(value.get("num_nonmembers")),
                nonmembers_needed=needed,
                fpr=_number(value.get("fpr")),
                fpr_ci95=_interval(value.get("fpr_ci95")),
                reason=value.get("reason") if isinstance(value.get("reason"), str) else None,
            )
        number = _number(value)
        return None if number is None else cls(tpr=number, detailed=False)


BOUND_TEST_KEYS = (
    "threshold",
    "inequality",
    "true_positives",
    "false_positives",
    "bound_members",
    "bound_nonmembers",
    "delta",
)


def _bound_test(value: Any) -> dict[str, Any] | None:
    """The recorded test of an epsilon lower bound, or None when absent or incomplete (format 1 had none)."""
    if not isinstance(value, dict) or not set(BOUND_TEST_KEYS) <= set(value):
        return None
    if value["threshold"] is not None and value["inequality"] not in ("tpr", "tnr"):
        return None
    counts = [value[key] for key in ("true_positives", "false_positives", "bound_members", "bound_nonmembers")]
    if any(_count(c) is None or c < 0 for c in counts) or _number(value["delta"]) is None:
        return None  # a test whose counts are not counts cannot be recomputed at another confidence
    return dict(value)


def _canary_audit(value: Any) -> dict[str, Any] | None:
    """An attack's "canary_audit" entry, or None when it is not one fedaudit writes in the parts a report shows:
    its counts, kind and threat model, its estimate with a two-number interval, each estimator's epsilon, and its
    bound by the number of guesses."""
    if not isinstance(value, dict):
        return None
    estimate = value.get("estimate")
    estimators = value.get("estimators")
    guesses = value.get("bound_by_guesses", [])
    well_formed = (
        _count(value.get("canaries")) is not None
        and isinstance(value.get("canary_kind"), (str, type(None)))
        and "canary_kind" in value
        and isinstance(value.get("threat_model"), str)
        and _number(value.get("per_estimator_confidence")) is not None
        and (value.get("informative_canaries") is None or _count(value.get("informative_canaries")) is not None)
        and (estimate is None or (isinstance(estimate, dict) and _interval(estimate.get("ci95")) is not None))
        and isinstance(estimators, dict)
        and all(
            isinstance(estimators.get(name), dict) and _number(estimators[name].get("epsilon")) is not None
            for name in ("one-run", "gdp")
        )
        and isinstance(guesses, list)
        and all(
            isinstance(point, dict)
            and _count(point.get("guesses")) is not None
            and _number(point.get("epsilon")) is not None
            for point in guesses
        )
    )
    return dict(value) if well_formed else None


def _risk(value: Any) -> dict[str, Any] | None:
    """An attack's "risk" entry, or None when it is not one fedaudit writes: "most_exposed" a list of records,
    "tpr_at_fpr_per_client" rates by integer client id."""
    if not isinstance(value, dict):
        return None
    exposed = value.get("most_exposed", [])
    per_client = value.get("tpr_at_fpr_per_client", {})
    if not isinstance(exposed, list) or not all(isinstance(row, dict) for row in exposed):
        return None
    if not isinstance(per_client, dict) or not all(
        str(client).isdigit() and isinstance(entry, dict) for client, entry in per_client.items()
    ):
        return None
    return dict(value)


@dataclass(frozen=True)
class AttackRecord:
    """attacks/<name>/metrics.json, written by ``fedaudit attack`` (formats 1 and 2), read by reports and studies.

    Absent or malformed numbers read as None, so an older result still shows what it has; ``name`` is the result
    directory's name, ``<signal>-<method>[-round-N]``.
    """

    name: str
    signal: str
    method: str
    format_version: int | None
    round: int | None
    seed: int | None
    settings: Mapping[str, Any]  # nonmembers, max_records, bootstrap_resamples, per_layer: what a study compares
    auc: float | None
    auc_ci95: tuple[float, float] | None
    auc_se: float | None
    tpr_at_fpr: Mapping[str, RateRecord | None]  # "0.01", "0.001"
    balanced_accuracy: float | None
    advantage: float | None
    advantage_held_out: float | None
    advantage_held_out_ci95: tuple[float, float] | None
    epsilon_lower_bound: float | None
    epsilon_lower_bound_test: Mapping[str, Any] | None
    accountant_epsilon: float | None
    num_members: int | None
    num_nonmembers: int | None
    canary_audit: Mapping[str, Any] | None = None  # a canary audit's estimators (its bound needs no threshold test)
    direction: str | None = None  # "inverted" when the whole AUC interval is below 0.5
    risk: Mapping[str, Any] | None = None  # the most exposed records and TPR at low FPR per client and class
    references: Mapping[str, Any] | None = None  # rmia / lira: the reference models used

    SETTINGS = ("seed", "nonmembers", "max_records", "bootstrap_resamples", "per_layer")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], name: str) -> AttackRecord:
        """The result in ``data`` (metrics.json), its directory called ``name``.

        Raises:
            RunError: a canary audit whose entry, or whose bound, is not what fedaudit writes (a report could not
                show it; an ordinary attack's malformed numbers read as None instead).
        """
        canary_audit = _canary_audit(data.get("canary_audit"))
        if "canary_audit" in data and (canary_audit is None or _number(data.get("epsilon_lower_bound")) is None):
            raise RunError(f"attacks/{name}/metrics.json holds a canary audit that is not one fedaudit writes.")
        signal, _, method = name.partition("-round-")[0].rpartition("-")
        rates = data.get("tpr_at_fpr") if isinstance(data.get("tpr_at_fpr"), dict) else {}
        held_out = data.get("advantage_held_out") if isinstance(data.get("advantage_held_out"), dict) else {}
        round_number = data.get("round")
        return cls(
            name=name,
            signal=str(data.get("signal", signal or name)),
            method=str(data.get("method", method)),
            format_version=_count(data.get("format_version")),
            round=int(round_number) if _number(round_number) is not None else None,
            seed=_count(data.get("seed")),
            settings={key: data.get(key) for key in cls.SETTINGS},
            auc=_number(data.get("auc")),
            auc_ci95=_interval(data.get("auc_ci95")),
            auc_se=_number(data.get("auc_se")),
            tpr_at_fpr={key: RateRecord.from_json(rates.get(key)) for key in ("0.01", "0.001")},
            balanced_accuracy=_number(data.get("balanced_accuracy")),
            advantage=_number(data.get("advantage")),
            advantage_held_out=_number(held_out.get("advantage")),
            advantage_held_out_ci95=_interval(held_out.get("ci95")),
            epsilon_lower_bound=_number(data.get("epsilon_lower_bound")),
            epsilon_lower_bound_test=_bound_test(data.get("epsilon_lower_bound_test")),
            accountant_epsilon=_number(data.get("accountant_epsilon")),
            num_members=_count(data.get("num_members")),
            num_nonmembers=_count(data.get("num_nonmembers")),
            canary_audit=canary_audit,
            direction=data["direction"]
            if data.get("direction") in ("inverted", "as expected", "undetermined")
            else None,
            risk=_risk(data.get("risk")),
            references=data["references"] if isinstance(data.get("references"), dict) else None,
        )


TEMPORARY_SUFFIX = ".tmp"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and an atomic rename.

    The file gets the mode an ordinary ``open`` would give it (0666 less the process
    umask), not the private 0600 of a temporary file, so colleagues can read shared runs.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask: from /proc where it is shown (no change to the process state, safe with threads), else read
    by setting it and setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# What tempfile.mkstemp names the temporary file of atomic_write_bytes: "." + the file's name + "." + 8 random
# characters + TEMPORARY_SUFFIX.
_TEMPORARY_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}" + re.escape(TEMPORARY_SUFFIX) + "$")


def remove_stale_temporaries(
    directory: Path, folders: tuple[str, ...] = ("", "checkpoints", "transmitted"), *, names: list[str] | None = None
) -> list[Path]:
    """Delete the temporary files that an interrupted :func:`atomic_write_bytes` of training left in ``directory``
    and its training ``folders`` (each folder and what is below it); nothing else, and nothing under attacks/.
    With ``names``, only the temporaries of files of those names."""
    stale: list[Path] = []
    for name in folders:
        folder = directory / name
        if not folder.is_dir():
            continue
        candidates = folder.glob("*") if not name else folder.rglob("*")
        stale += [
            p
            for p in candidates
            if p.is_file()
            and _TEMPORARY_NAME.match(p.name)
            and (names is None or any(p.name.startswith(f".{name}.") for name in names))
        ]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def json_bytes(data: Any) -> bytes:
    """Pretty-printed JSON, UTF-8, with a final newline."""
    return (json.dumps(data, indent=2, sort_keys=False) + "\n").encode("utf-8")


def atomic_write_json(path: Path, data: Any) -> None:
    """Atomically write pretty-printed JSON."""
    atomic_write_bytes(path, json_bytes(data))


def csv_bytes(frame: pd.DataFrame) -> bytes:
    """A table as UTF-8 CSV whose floats read back exactly, whatever the pandas version (shortest round-trip repr)."""
    return frame.to_csv(index=False, float_format=lambda value: repr(float(value))).encode("utf-8")


def arrays_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Named arrays as a compressed .npz."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Atomically write named arrays as a compressed .npz."""
    atomic_write_bytes(path, arrays_bytes(arrays))


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an .npz, with pickled objects refused; a corrupt file is a :class:`RunError`."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (ValueError, OSError) as exc:
        raise RunError(f"{path} is corrupt.") from exc


def tensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Tensors as safetensors (contiguous CPU copies), byte-identical for equal inputs."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return _canonical_header(save(cpu, metadata=dict(metadata or {})))


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Atomically write tensors as safetensors (contiguous CPU copies), byte-identical for equal inputs."""
    atomic_write_bytes(path, tensors_bytes(tensors, metadata))


def _canonical_header(data: bytes) -> bytes:
    """Rewrite a safetensors header with its metadata keys sorted.

    safetensors keeps ``__metadata__`` in a hash map whose iteration order
    varies from call to call, so the same weights and metadata could give
    different bytes; the same run must give the same file.
    """
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    metadata = header.pop("__metadata__", None)
    ordered = ({"__metadata__": dict(sorted(metadata.items()))} if metadata else {}) | header
    text = json.dumps(ordered, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the format pads the header with spaces to 8-byte alignment
    return len(text).to_bytes(8, "little") + text + data[8 + size :]


def load_tensors(
    path: Path, device: str | torch.device = "cpu", keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """Read a safetensors file (only the tensors whose names ``keep`` accepts, where given); a missing or corrupt
    file is a :class:`RunError`."""
    if not path.is_file():
        raise RunError(f"Expected the weights file {path}, which does not exist.")
    try:
        if keep is None:
            return load_file(str(path), device=str(device))
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            return {name: handle.get_tensor(name) for name in handle.keys() if keep(name)}
    except (SafetensorError, OSError, ValueError) as exc:
        raise RunError(f"The weights file {path} is corrupt or not a safetensors file.") from exc


def tensor_names(path: Path) -> list[str]:
    """The names of the tensors of a safetensors file (read from its header only)."""
    if not path.is_file():
        raise RunError(f"Expected the weights file {path}, which does not exist.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise RunError(f"The weights file {path} is corrupt or not a safetensors file.") from exc


def _client_of(name: str) -> int:
    """The client id of a clients file's tensor name ("client<k>/<name>")."""
    return int(name.split("/", 1)[0].removeprefix("client"))


def _clients_in(names: Iterable[str]) -> set[int]:
    return {_client_of(name) for name in names}


def tensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a safetensors file (read from its header only)."""
    if not path.is_file():
        raise RunError(f"Expected the weights file {path}, which does not exist.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise RunError(f"The weights file {path} is corrupt or not a safetensors file.") from exc


def versions() -> dict[str, str]:
    """Versions recorded in the manifest, so a run can be reproduced and checked later (Opacus' from its installed
    metadata: importing it takes a second and 70 MB, which a run that needs only its RDP analysis never spends)."""
    return {
        "fedaudit": fedaudit.__version__,
        "torch": torch.__version__,
        "opacus": importlib.metadata.version("opacus"),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def now_iso() -> str:
    """Current UTC time, ISO 8601."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RunDirectory:
    """Reads and writes one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, str] | None = None  # committed hashes, loaded from manifest.json when first needed
        self._staged: dict[Path, bytes | None] | None = None  # a commit being gathered (None: a deletion)
        self._staged_manifest: Manifest | None = None
        self.destination: Path | None = None  # where a run built under a temporary name goes once it has a round
        self._pending: dict[str, str | None] = {}  # hashes of a commit under way: kept if it is interrupted

    config_path = property(lambda self: self.path / "config.json")
    manifest_path = property(lambda self: self.path / "manifest.json")
    membership_path = property(lambda self: self.path / "membership.npz")
    canaries_path = property(lambda self: self.path / "canaries.npz")  # secret inclusion bits of a canary audit
    metrics_path = property(lambda self: self.path / "metrics.csv")
    privacy_path = property(lambda self: self.path / "privacy.json")
    model_path = property(lambda self: self.path / "model.safetensors")
    checkpoints_dir = property(lambda self: self.path / "checkpoints")
    transmitted_dir = property(lambda self: self.path / "transmitted")
    attacks_dir = property(lambda self: self.path / "attacks")  # written by fedaudit attack, read by reports
    queries_dir = property(lambda self: self.path / "queries")  # canary runs: the query log of every round
    verification_path = property(lambda self: self.path / "verification.json")  # written by fedaudit verify
    secrets_path = property(lambda self: self.path / SECRETS_FILE)  # the simulated clients' secrets (mode 0600)

    def attack_names(self) -> list[str]:
        """The attack result directories under attacks/ that hold a metrics.json (written last), sorted."""
        folder = self.attacks_dir
        return sorted(p.parent.name for p in folder.glob("*/metrics.json")) if folder.is_dir() else []

    def read_attack(self, name: str) -> AttackRecord | None:
        """attacks/``name``/metrics.json as an :class:`AttackRecord`; None when it is not a JSON object.

        Raises:
            RunError: the file is missing, unreadable or not JSON, or a field is malformed.
        """
        data = self.read_json(self.attacks_dir / name / "metrics.json")
        return AttackRecord.from_dict(data, name) if isinstance(data, dict) else None

    def checkpoint_path(self, round_number: int) -> Path:
        """Weights of the global model after round ``round_number`` (1-based)."""
        return self.checkpoints_dir / f"round-{round_number:04d}.safetensors"

    def checkpoint_state_path(self, round_number: int) -> Path:
        """RNG state and bookkeeping saved with the checkpoint of ``round_number``."""
        return self.checkpoints_dir / f"round-{round_number:04d}.json"

    def is_run(self) -> bool:
        """True if the directory holds a fedaudit manifest."""
        return self.manifest_path.is_file()

    def is_half_made(self) -> bool:
        """A directory left by a start that was killed before its manifest existed (fedaudit before 0.2 built a run
        in place): config.json, no manifest, and nothing but the files a start writes."""
        if not self.path.is_dir() or self.is_run() or not self.config_path.is_file():
            return False
        start = {"config.json", "membership.npz", "canaries.npz", integrity.LOCK}
        return all(
            p.name in start or integrity.untracked(p.name) for p in self.path.iterdir() if p.is_file()
        ) and not any(p.is_dir() for p in self.path.iterdir())

    def lock(self, command: str, *, shared: bool = False) -> integrity.RunLock:
        """The run's one-writer lock (``shared`` for a reader), taken now; a :class:`LockedError` names the holder.

        A writer that takes it also clears the temporaries that a killed writer left beside the run's own files
        (a half-written manifest.json, say): while the lock is held no other writer runs, so they are stale."""
        if not self.path.is_dir():
            raise RunError(f"{self.path} is not a directory; expected a run directory written by 'fedaudit train'.")
        lock = integrity.RunLock(self.path, command, shared).acquire()
        if not shared:
            remove_stale_temporaries(self.path, ("",))
        return lock

    @classmethod
    def start_new(cls, out: str | Path, overwrite: bool) -> tuple[RunDirectory, list[integrity.RunLock]]:
        """A new run, built under a temporary name beside ``out`` and locked; :meth:`publish` renames it into place
        once its first round is committed, so a start that fails or is killed leaves nothing at ``out``.

        Returns the new run and the locks it holds (with ``overwrite``, also the lock of the run it replaces).
        """
        target = cls(out)
        path = target.path
        if not str(out).strip():
            raise RunError("--out must name a run directory, not an empty path.")
        if path.exists() and not path.is_dir():
            raise RunError(f"--out {path} exists and is not a directory.")
        locks: list[integrity.RunLock] = []
        if path.exists() and any(path.iterdir()):
            half = target.is_half_made()
            if not overwrite:
                if half:
                    raise RunError(
                        f"--out {path} holds a run whose start was interrupted (config.json but no manifest.json); "
                        "pass --overwrite to replace it."
                    )
                raise RunError(
                    f"--out {path} already exists; pass --resume {path} to continue it or --overwrite to replace it."
                )
            if not target.is_run() and not half:
                raise RunError(
                    f"--out {path} is a non-empty directory that is not a fedaudit run; refusing to overwrite it."
                )
            locks.append(target.lock("fedaudit train --overwrite"))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for leftover in sorted(path.parent.glob(f".{path.name}.partial-*")) + sorted(
                path.parent.glob(f".{path.name}.replaced-*")
            ):
                if integrity.is_locked(leftover):
                    raise integrity.LockedError(
                        f"--out {path} is being created by another fedaudit command ({leftover.name} is locked)."
                    )
                shutil.rmtree(leftover, ignore_errors=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
            os.chmod(partial, 0o777 & ~_umask())
        except OSError as exc:
            for held in locks:
                held.release()
            raise RunError(f"Cannot create the run directory {path}: {exc.strerror or exc}.") from exc
        run = cls(partial)
        run.destination = path
        locks.append(run.lock("fedaudit train"))
        return run, locks

    def publish(self) -> None:
        """Rename a run built by :meth:`start_new` into place, replacing (with its lock held) the run it overwrites."""
        if self.destination is None:
            return
        target, aside = self.destination, None
        if target.exists():
            aside = target.parent / f".{target.name}.replaced-{os.getpid()}"
            os.rename(target, aside)
        try:
            os.rename(self.path, target)
        except OSError as exc:
            if aside is not None:
                os.rename(aside, target)
            raise RunError(f"Cannot move the new run into {target}: {exc.strerror or exc}.") from exc
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self.path, self.destination = target, None

    def discard(self) -> None:
        """Remove a run that :meth:`start_new` began and never published (its start failed or was interrupted)."""
        if self.destination is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def write_config(self, config: dict[str, Any]) -> None:
        self.put(self.config_path, json_bytes(config))

    def read_json(self, path: Path) -> Any:
        """Read one of the run's JSON files; missing, too large (:data:`MAX_RUN_TEXT_BYTES`, checked before reading)
        or malformed is a :class:`RunError`."""
        try:
            bounded_size(path)
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise RunError(f"{self.path} is not a complete fedaudit run: {path.name} is missing.") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunError(f"{path} is corrupt (not valid JSON).") from exc
        except RecursionError as exc:
            raise RunError(f"{path} is corrupt (nested deeper than fedaudit writes).") from exc
        except OSError as exc:
            raise RunError(f"Cannot read {path}: {exc.strerror or exc}.") from exc

    def read_config(self) -> dict[str, Any]:
        return self.read_json(self.config_path)

    def read_manifest(self) -> Manifest:
        """The manifest, checked to be a fedaudit run of a format this version reads, with every entry valid."""
        if not self.path.is_dir():
            raise RunError(f"{self.path} is not a directory; expected a run directory written by 'fedaudit train'.")
        if not self.manifest_path.exists() and self.is_half_made():
            raise RunError(
                f"{self.path} is a run whose start was interrupted before its first round (config.json but no "
                "manifest.json); start it again with 'fedaudit train --out PATH --overwrite'."
            )
        manifest = self.read_json(self.manifest_path)
        if not isinstance(manifest, dict) or manifest.get("format") != RUN_FORMAT:
            raise RunError(
                f"{self.path} is not a fedaudit run directory (its manifest.json has no fedaudit format tag)."
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise RunError(
                f"{self.path} was written in run format {manifest.get('format_version')!r} but this fedaudit reads "
                f"format {FORMAT_VERSION}."
            )
        return Manifest.from_dict(manifest, str(self.manifest_path))

    def write_manifest(self, manifest: Manifest) -> None:
        """Write the manifest with the hashes of every file committed so far; inside :meth:`staged`, last."""
        if self._staged is not None:
            self._staged_manifest = manifest
            return
        self._write_manifest_document(manifest.to_dict(), self._hashes(), self._pending)

    def _write_manifest_document(
        self, entries: Mapping[str, Any], files: Mapping[str, str], pending: Mapping[str, str | None] | None
    ) -> None:
        document = {"format": RUN_FORMAT, "format_version": FORMAT_VERSION, **entries, "updated": now_iso()}
        document["files"] = dict(sorted(files.items()))
        if pending:
            document["pending"] = dict(sorted(pending.items()))
        atomic_write_json(self.manifest_path, document)

    def _hashes(self) -> dict[str, str]:
        """The committed hashes: this object's, or manifest.json's when it has not written any yet, with an
        interrupted commit's files taken as they are (every writer checks the run's integrity before it writes)."""
        if self._files is None:
            self._files = {}
            if self.manifest_path.is_file():
                recorded = integrity.read_hashes(self.read_json(self.manifest_path))
                self._files = integrity.settled(self.path, *recorded) if recorded else {}
        return self._files

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

    def put(self, path: Path, data: bytes) -> None:
        """Write one of the run's files (a path inside it) with its hash: gathered into the commit of
        :meth:`staged`, else committed on its own."""
        if self._staged is not None:
            self._staged[path] = data
        else:
            self._commit({path: data})

    def remove(self, paths: list[Path]) -> None:
        """Delete files of the run and their hashes (in the commit of :meth:`staged`, else on their own)."""
        if self._staged is not None:
            self._staged.update(dict.fromkeys(paths))
        else:
            self._commit(dict.fromkeys(paths))

    @contextmanager
    def staged(self) -> Iterator[None]:
        """Gather every file written (and the manifest) in the block into one commit, made when it ends: the
        manifest first records the new hashes as pending, then the files are written, then the manifest commits them.
        A crash at any moment leaves each file in its old or its new state, both of which check; an exception in the
        block writes nothing."""
        self._staged, self._staged_manifest = {}, None
        try:
            yield
            staged, manifest = self._staged, self._staged_manifest
        finally:
            self._staged = self._staged_manifest = None
        self._commit(staged, manifest)

    def _commit(self, contents: Mapping[Path, bytes | None], manifest: Manifest | None = None) -> None:
        if not contents and manifest is None:
            return
        files = self._hashes()
        new = {self._relative(p): None if b is None else integrity.digest(b) for p, b in contents.items()}
        exists = self.manifest_path.is_file()
        entries: dict[str, Any] = {}
        if exists:
            current = self.read_json(self.manifest_path)
            entries = {
                k: v for k, v in current.items() if k not in ("format", "format_version", "updated", "files", "pending")
            }
            self._pending = {**self._pending, **new}
            self._write_manifest_document(entries, files, self._pending)
        for path, data in contents.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                atomic_write_bytes(path, data)
        for relative, value in new.items():
            if value is None:
                files.pop(relative, None)
            else:
                files[relative] = value
        self._pending = {}
        if manifest is not None:
            self._write_manifest_document(manifest.to_dict(), files, None)
        elif exists:
            self._write_manifest_document(entries, files, None)

    def integrity_problems(self) -> list[str]:
        """Every way the run differs from what fedaudit wrote: files changed, missing or added since their commit, a
        privacy ledger that its own events or config.json contradict; one sentence each (none: the run checks)."""
        return [sentence for _, sentence in self.integrity_findings()]

    def integrity_findings(self) -> list[tuple[str, str]]:
        """:meth:`integrity_problems` as (file, sentence) pairs, so that a reader can leave untrusted files unread
        (the manifest itself is named "manifest.json", a contradicted ledger "privacy.json")."""
        document = self.read_json(self.manifest_path)
        recorded = integrity.read_hashes(document) if isinstance(document, dict) else None
        if recorded is None:
            return [
                (
                    integrity.MANIFEST,
                    "manifest.json records no SHA-256 of the run's files (written before fedaudit 0.9, or edited)",
                )
            ]
        findings = integrity.file_findings(self.path, *recorded)
        unreadable = any(name in ("privacy.json", "config.json") for name, _ in findings)
        if self.privacy_path.is_file() and not unreadable:
            config = self.read_json(self.config_path) if self.config_path.is_file() else {}
            privacy = config.get("privacy") if isinstance(config, dict) else None
            ledger = self.read_json(self.privacy_path)
            done = document.get("rounds_done") if isinstance(document.get("rounds_done"), int) else 0
            if isinstance(ledger, dict):
                problems = integrity.ledger_problems(ledger, privacy if isinstance(privacy, dict) else None, done)
            else:
                problems = ["privacy.json is not a ledger (not a JSON object)"]
            findings += [("privacy.json", problem) for problem in problems]
        return findings

    def check_integrity(self, action: str) -> None:
        """Refuse to ``action`` a run whose files or ledger were changed: an :class:`IntegrityError` naming the
        first problem (and how many more there are)."""
        problems = self.integrity_problems()
        if problems:
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            raise integrity.IntegrityError(f"Refusing to {action} {self.path}: {problems[0]}{more}.")

    signature_path = property(lambda self: self.path / integrity.SIGNATURE)

    def sign(self, key_pem: bytes, where: str) -> None:
        """Write signature.json: an Ed25519 signature (key from PEM ``key_pem``, read from ``where``) over the
        manifest, which holds every file's hash; a run whose files do not check is not signed."""
        problems = self.integrity_problems()
        if problems:
            raise integrity.IntegrityError(f"Refusing to sign {self.path}: {problems[0]}.")
        atomic_write_json(self.signature_path, integrity.sign(self.read_json(self.manifest_path), key_pem, where))

    def export(self, out: str | Path) -> int:
        """Copy the run to ``out`` for someone else (an auditor, a server): every file the manifest hashes, the
        manifest and its signature, and nothing else: never the simulated clients' secrets, whose holder can remove
        the noise, nor the lock, temporaries or caches. Built beside ``out`` under a temporary name and renamed into
        place. Returns the number of files copied.

        Raises:
            RunError: ``out`` exists and is not an empty directory, or cannot be written.
            IntegrityError: the run's files do not check (a copy would pass them on).
        """
        target = Path(out)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise RunError(f"--out {target} already exists; export into a new directory.")
        problems = self.integrity_problems()
        if problems:
            raise integrity.IntegrityError(f"Refusing to export {self.path}: {problems[0]}.")
        document = self.read_json(self.manifest_path)
        recorded = integrity.read_hashes(document) or ({}, {})
        names = sorted({*recorded[0], *(k for k, v in recorded[1].items() if v is not None)})
        names = [n for n in names if (self.path / n).is_file()]
        names += [n for n in (integrity.MANIFEST, integrity.SIGNATURE) if (self.path / n).is_file()]
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            building = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
        except OSError as exc:
            raise RunError(f"Cannot create {target}: {exc.strerror or exc}.") from exc
        try:
            os.chmod(building, 0o777 & ~_umask())
            for name in names:
                destination = building / name
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.path / name, destination)
            if target.exists():
                target.rmdir()
            os.rename(building, target)
        except OSError as exc:
            raise RunError(f"Cannot write the copy of {self.path} to {target}: {exc.strerror or exc}.") from exc
        finally:
            shutil.rmtree(building, ignore_errors=True)
        return len(names)

    def signature_problems(self, public_key: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Whether the run was signed with ``public_key`` (raw Ed25519) and still holds what was signed: every field of
        the manifest (its file hashes aside, which grow with attack results) and every signed file. Returns the
        problems, and the results written or rewritten since signing (attack results, and verify's own
        verification.json, which every verify rewrites): computed from the run, they are not covered."""
        if not self.signature_path.is_file():
            return (f"{integrity.SIGNATURE} is missing: the run was not signed ('fedaudit sign')",), ()
        problems, signed = integrity.signature_problems(self.read_json(self.signature_path), public_key)
        recorded = None if signed is None else integrity.read_hashes(signed)
        if recorded is None:
            return tuple(problems or [f"{integrity.SIGNATURE} holds no file hashes"]), ()
        changed, rewritten = [], []
        current = self.read_json(self.manifest_path)
        for key in sorted((set(signed) | set(current)) - _GROWS_AFTER_SIGNING):
            if signed.get(key) != current.get(key):
                changed.append(f"{integrity.MANIFEST}'s {key} changed after the run was signed")
        for relative, expected in sorted(recorded[0].items()):
            path = self.path / relative
            if not path.is_file() or integrity.file_digest(path) != expected:
                if relative == self.verification_path.name or relative.startswith(f"{self.attacks_dir.name}/"):
                    rewritten.append(relative)  # a result computed from the run, rewritten by a later verify or attack
                    continue
                changed.append(f"{relative} changed after the run was signed")
        unsigned = tuple(sorted({*rewritten, *(set(integrity.present_files(self.path)) - set(recorded[0]))}))
        return tuple(changed), unsigned

    def settle(self) -> None:
        """After an interrupted commit whose files check, take every file as it now is as committed, before writing
        again (a resume)."""
        document = self.read_json(self.manifest_path)
        recorded = integrity.read_hashes(document)
        if recorded is None or not recorded[1]:
            return
        self._files = integrity.settled(self.path, *recorded)
        entries = {
            k: v for k, v in document.items() if k not in ("format", "format_version", "updated", "files", "pending")
        }
        self._write_manifest_document(entries, self._files, None)

    def read_run_config(self) -> RunConfig:
        """config.json as a checked :class:`RunConfig`; a malformed one or a bad value is a :class:`RunError`."""
        try:
            config = RunConfig.from_dict(self.read_config())
            config.validate()
            return config
        except (ConfigError, TypeError) as exc:
            raise RunError(f"{self.config_path} is not a valid fedaudit configuration: {exc}") from exc

    def check_dataset(self, dataset: Dataset) -> None:
        """The data found now must be the data the run was trained on (same fingerprint), or a :class:`RunError`."""
        if dataset.fingerprint != self.read_manifest().dataset.fingerprint:
            raise RunError(
                f"The {dataset.name} data found now differs from the data {self.path} was trained on "
                "(fingerprint mismatch)."
            )

    def write_membership(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.put(self.membership_path, arrays_bytes(arrays))

    def read_membership(self) -> dict[str, np.ndarray]:
        """The member/non-member index arrays (no pickled objects allowed)."""
        if not self.membership_path.is_file():
            raise RunError(f"{self.path} is not a complete fedaudit run: membership.npz is missing.")
        return read_arrays(self.membership_path)

    def write_canaries(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.put(self.canaries_path, arrays_bytes(arrays))

    def read_canaries(self) -> dict[str, np.ndarray] | None:
        """The canaries' arrays (no pickled objects), or None for a run trained without canaries."""
        return read_arrays(self.canaries_path) if self.canaries_path.is_file() else None

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        frame = pd.DataFrame(rows)
        ordered = [c for c in METRIC_COLUMNS if c in frame.columns] + [
            c for c in frame.columns if c not in METRIC_COLUMNS
        ]
        self.put(self.metrics_path, csv_bytes(frame[ordered]))

    def read_metrics(self) -> pd.DataFrame:
        if not self.metrics_path.is_file():
            return pd.DataFrame(columns=list(METRIC_COLUMNS))
        bounded_size(self.metrics_path)
        try:
            metrics = pd.read_csv(self.metrics_path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunError(f"{self.metrics_path} is not a readable CSV file ({first}).") from exc
        for column in METRIC_COLUMNS:
            if column in metrics.columns and not pd.api.types.is_numeric_dtype(metrics[column]):
                raise RunError(f"{self.metrics_path}: its column {column!r} holds values that are not numbers.")
        return metrics

    def write_privacy(self, ledger: dict[str, Any]) -> None:
        self.put(self.privacy_path, json_bytes(ledger))

    def read_privacy(self) -> dict[str, Any] | None:
        """The privacy ledger, or None for a non-DP run."""
        return self.read_json(self.privacy_path) if self.privacy_path.is_file() else None

    def save_checkpoint(self, round_number: int, params: Mapping[str, torch.Tensor], state: dict[str, Any]) -> None:
        self.put(self.checkpoint_path(round_number), tensors_bytes(params, {"round": str(round_number)}))
        self.put(self.checkpoint_state_path(round_number), json_bytes(state))

    def load_checkpoint(
        self, round_number: int, device: str | torch.device = "cpu"
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        params = load_tensors(self.checkpoint_path(round_number), device)
        return params, self.read_json(self.checkpoint_state_path(round_number))

    def checkpoint_files(self, round_number: int) -> list[Path]:
        """Every file of round ``round_number``'s checkpoint that exists (weights, state, clients', server's)."""
        paths = [
            self.checkpoint_path(round_number),
            self.checkpoint_state_path(round_number),
            self.client_states_path(round_number),
            self.server_state_path(round_number),
            self.server_state_path(round_number, kept=True),
        ]
        return [p for p in paths if p.is_file()]

    def client_states_path(self, round_number: int) -> Path:
        """What clients keep between rounds (e.g. FedLAP synthetic sets), saved with the checkpoint."""
        return self.checkpoints_dir / f"round-{round_number:04d}-clients.safetensors"

    def save_client_states(self, round_number: int, states: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """The client states round ``round_number`` changed (and any carried over from a removed checkpoint)."""
        flat = {f"client{k}/{name}": t for k, state in states.items() for name, t in state.items()}
        self.put(self.client_states_path(round_number), tensors_bytes(flat, {"round": str(round_number)}))

    def clients_with_states(self, round_number: int) -> set[int]:
        """The clients whose states round ``round_number``'s clients file holds (none if it has no such file)."""
        path = self.client_states_path(round_number)
        return _clients_in(tensor_names(path)) if path.is_file() else set()

    def client_state_index(self, upto: int) -> dict[int, int]:
        """For every client with a state after round ``upto``: the round whose clients file holds that state (the
        last one, up to ``upto``, that has the client). Only the files' headers are read."""
        index: dict[int, int] = {}
        for number in range(1, upto + 1):
            path = self.client_states_path(number)
            if path.is_file():
                index.update(dict.fromkeys(_clients_in(tensor_names(path)), number))
        return index

    def client_states_at(
        self, round_number: int, device: str | torch.device = "cpu", clients: Collection[int] | None = None
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every client's state (or ``clients``') as it was after round ``round_number``, from the round files
        that hold them."""
        index = self.client_state_index(round_number)
        return self.read_client_states({k: n for k, n in index.items() if clients is None or k in clients}, device)

    def read_client_states(
        self, where: Mapping[int, int], device: str | torch.device = "cpu"
    ) -> dict[int, dict[str, torch.Tensor]]:
        """The states of the clients of ``where`` (client -> the round whose clients file holds its state), each
        file read once and only for those clients' tensors."""
        files: dict[int, set[int]] = {}
        for k, number in where.items():
            files.setdefault(number, set()).add(k)
        states: dict[int, dict[str, torch.Tensor]] = {}
        for number, ks in sorted(files.items()):
            stored = self.load_client_states(number, device, ks)
            states.update({k: stored[k] for k in ks})
        return dict(sorted(states.items()))

    def load_client_states(
        self, round_number: int, device: str | torch.device = "cpu", clients: Collection[int] | None = None
    ) -> dict[int, dict[str, torch.Tensor]]:
        """The states round ``round_number``'s clients file holds (only ``clients``', read alone, where given)."""
        path = self.client_states_path(round_number)
        if not path.is_file():
            return {}
        keep = None if clients is None else (lambda name: _client_of(name) in clients)
        states: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in load_tensors(path, device, keep).items():
            states.setdefault(_client_of(key), {})[key.split("/", 1)[1]] = tensor
        return states

    def server_state_path(self, round_number: int, *, kept: bool = False) -> Path:
        """What the server broadcasts besides the weights (SCAFFOLD's control variate) or, ``kept``, keeps to itself
        (FedGM's received sets), saved with the checkpoint."""
        suffix = "server-kept" if kept else "server"
        return self.checkpoints_dir / f"round-{round_number:04d}-{suffix}.safetensors"

    def save_server_state(self, round_number: int, state: Mapping[str, torch.Tensor], *, kept: bool = False) -> None:
        self.put(self.server_state_path(round_number, kept=kept), tensors_bytes(state, {"round": str(round_number)}))

    def load_server_state(
        self, round_number: int, device: str | torch.device = "cpu", *, kept: bool = False
    ) -> dict[str, torch.Tensor]:
        path = self.server_state_path(round_number, kept=kept)
        return load_tensors(path, device) if path.is_file() else {}

    def save_transmitted(self, round_number: int, client_id: int, payload: Mapping[str, torch.Tensor]) -> None:
        """What one client sent in one round, for audits of what crossed the wire."""
        path = self.transmitted_dir / f"round-{round_number:04d}" / f"client-{client_id:03d}.safetensors"
        self.put(path, tensors_bytes(payload, {"round": str(round_number), "client": str(client_id)}))

    def queries_path(self, round_number: int) -> Path:
        return self.queries_dir / f"round-{round_number:04d}.safetensors"

    def save_queries(self, round_number: int, logs: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """A canary run's query logs of one round (fedaudit.queries), by client, in one file."""
        flat = {f"client-{k:03d}/{name}": t for k, log in sorted(logs.items()) for name, t in log.items()}
        self.put(self.queries_path(round_number), tensors_bytes(flat, {"round": str(round_number)}))

    def load_queries(self, round_number: int) -> dict[int, dict[str, torch.Tensor]]:
        """The query logs of one round by client; a round that wrote none is a :class:`RunError`."""
        logs: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in load_tensors(self.queries_path(round_number)).items():
            client, _, name = key.partition("/")
            if not client.startswith("client-") or not client[7:].isdigit() or not name:
                raise RunError(f"{self.queries_path(round_number)} holds an entry {key!r} that is not a query log.")
            logs.setdefault(int(client[7:]), {})[name] = tensor
        return logs

    def saved_rounds(self) -> list[int]:
        """Round numbers that have a checkpoint, ascending."""
        if not self.checkpoints_dir.is_dir():
            return []
        return sorted(
            int(p.stem.split("-")[1]) for p in self.checkpoints_dir.glob("round-[0-9][0-9][0-9][0-9].safetensors")
        )

    def save_model(self, params: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        self.put(self.model_path, tensors_bytes(params, metadata))

    def model_spec(self) -> ModelSpec:
        """The architecture recorded in manifest.json's "model" entry, to rebuild the model without unpickling."""
        return self.read_manifest().model.spec

    def load_model(self, round_number: int | None = None, device: str | torch.device = "cpu") -> nn.Module:
        """The global model after ``round_number`` (a checkpoint), or the final model.safetensors when None.

        The model is rebuilt from :meth:`model_spec` and filled from safetensors only; the
        stored tensors must match its parameters name for name and shape for shape. The final
        model must be the one of the last committed round (a run interrupted between writing
        model.safetensors and its manifest is reported as incomplete).
        """
        spec = self.model_spec()
        if round_number is None:
            path = self.model_path
            done = self.read_manifest().rounds_done
            stored = tensors_metadata(path).get("round")
            if stored != str(done):
                raise RunError(
                    f"{self.path} is incomplete: model.safetensors is from round {stored} but manifest.json records "
                    f"{done} completed rounds; resume the run with 'fedaudit train --resume {self.path}' first."
                )
        else:
            path = self.checkpoint_path(round_number)
        tensors = load_tensors(path, device)
        model = build_model(spec).to(device)
        expected = model.state_dict()
        if set(tensors) != set(expected) or any(tensors[k].shape != v.shape for k, v in expected.items()):
            raise RunError(f"The weights in {path} do not fit the {spec.arch} model described in {self.manifest_path}.")
        odd = next((k for k, v in expected.items() if tensors[k].dtype != v.dtype), None)
        if odd is not None:
            raise RunError(
                f"The weights in {path} are {str(tensors[odd].dtype).removeprefix('torch.')} ({odd}) but fedaudit "
                f"trains {str(expected[odd].dtype).removeprefix('torch.')} models; they were not written by fedaudit."
            )
        model.load_state_dict(tensors)
        model.eval()
        return model

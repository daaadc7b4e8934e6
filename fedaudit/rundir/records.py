"""What manifest.json records about a run (its dataset, model, clients, randomness and progress), read back with every
field checked, so that a hand-edited or foreign manifest is one sentence rather than a crash later."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedaudit.models import ModelSpec
from fedaudit.privacy.randomness import RUN_SEED, SOURCES
from fedaudit.rundir.files import RunError

RUN_FORMAT = "fedaudit-run"
FORMAT_VERSION = 1


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

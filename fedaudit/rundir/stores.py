"""The stores of a run directory beside its contract: the rounds' checkpoints, what clients and the server keep
between rounds, what crossed the wire, a canary run's query logs, and the attacks' results. Each is reached from its
:class:`~fedaudit.rundir.directory.RunDirectory` (``run.checkpoints``, ``run.states``, ``run.wire``,
``run.queries``, ``run.attacks``) and writes through it, so that every file joins the run's commits."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from fedaudit.rundir.attack_records import AttackRecord
from fedaudit.rundir.files import RunError, json_bytes, load_tensors, tensor_names, tensors_bytes

SECURE_SUM_FILE = "secure-sum.safetensors"  # a round's payloads as the server received them under secure aggregation


class RunFiles(Protocol):
    """What the stores and the seal need of their run directory (a RunDirectory): where its files are, and how
    it reads them and writes them into its commits."""

    path: Path
    states: StateStore

    @property
    def checkpoints_dir(self) -> Path: ...
    @property
    def transmitted_dir(self) -> Path: ...
    @property
    def queries_dir(self) -> Path: ...
    @property
    def attacks_dir(self) -> Path: ...
    @property
    def manifest_path(self) -> Path: ...
    @property
    def config_path(self) -> Path: ...
    @property
    def privacy_path(self) -> Path: ...
    @property
    def verification_path(self) -> Path: ...
    @property
    def signature_path(self) -> Path: ...

    def put(self, path: Path, data: bytes) -> None: ...
    def read_json(self, path: Path) -> Any: ...


def _round_name(round_number: int) -> str:
    return f"round-{round_number:04d}"


def _client_of(name: str) -> int:
    """The client id of a clients file's tensor name ("client<k>/<name>")."""
    return int(name.split("/", 1)[0].removeprefix("client"))


def _clients_in(names: Iterable[str]) -> set[int]:
    return {_client_of(name) for name in names}


class Store:
    """One kind of the run's files, kept in the run's own commits (``self.run``)."""

    def __init__(self, run: RunFiles) -> None:
        self.run = run


class CheckpointStore(Store):
    """checkpoints/: the global model's weights after each round, with the RNG state and bookkeeping saved beside
    them (what ``--resume`` restarts from, and what an attack on an earlier round reads)."""

    def path(self, round_number: int) -> Path:
        """Weights of the global model after round ``round_number`` (1-based)."""
        return self.run.checkpoints_dir / f"{_round_name(round_number)}.safetensors"

    def state_path(self, round_number: int) -> Path:
        """RNG state and bookkeeping saved with the checkpoint of ``round_number``."""
        return self.run.checkpoints_dir / f"{_round_name(round_number)}.json"

    def save(self, round_number: int, params: Mapping[str, torch.Tensor], state: dict[str, Any]) -> None:
        self.run.put(self.path(round_number), tensors_bytes(params, {"round": str(round_number)}))
        self.run.put(self.state_path(round_number), json_bytes(state))

    def load(
        self, round_number: int, device: str | torch.device = "cpu"
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.params(round_number, device), self.run.read_json(self.state_path(round_number))

    def params(self, round_number: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The weights alone (a copy of a client-level run for others holds no state file: it records the sample)."""
        return load_tensors(self.path(round_number), device)

    def files(self, round_number: int) -> list[Path]:
        """Every file of round ``round_number``'s checkpoint that exists (weights, state, clients', server's)."""
        states = self.run.states
        paths = [
            self.path(round_number),
            self.state_path(round_number),
            states.path(round_number),
            states.server_path(round_number),
            states.server_path(round_number, kept=True),
        ]
        return [p for p in paths if p.is_file()]

    def rounds(self) -> list[int]:
        """Round numbers that have a checkpoint, ascending."""
        folder = self.run.checkpoints_dir
        if not folder.is_dir():
            return []
        return sorted(int(p.stem.split("-")[1]) for p in folder.glob("round-[0-9][0-9][0-9][0-9].safetensors"))


class StateStore(Store):
    """What clients keep between rounds (FedLAP's synthetic sets, SCAFFOLD's control variates) and what the server
    broadcasts besides the weights or keeps to itself, saved with each round's checkpoint. A round's clients file
    holds only the clients whose state it changed: a client's state is in the last file, up to a round, that has it."""

    def path(self, round_number: int) -> Path:
        """The clients file of round ``round_number``."""
        return self.run.checkpoints_dir / f"{_round_name(round_number)}-clients.safetensors"

    def save(
        self, round_number: int, states: Mapping[int, Mapping[str, torch.Tensor]], salt: str | None = None
    ) -> None:
        """The client states round ``round_number`` changed (and any carried over from a removed checkpoint); with
        the ``salt`` of a private record (fedaudit.rundir.private) in its metadata."""
        flat = {f"client{k}/{name}": t for k, state in states.items() for name, t in state.items()}
        metadata = {"round": str(round_number), **({"salt": salt} if salt else {})}
        self.run.put(self.path(round_number), tensors_bytes(flat, metadata))

    def clients_in(self, round_number: int) -> set[int]:
        """The clients whose states round ``round_number``'s clients file holds (none if it has no such file)."""
        path = self.path(round_number)
        return _clients_in(tensor_names(path)) if path.is_file() else set()

    def index(self, upto: int) -> dict[int, int]:
        """For every client with a state after round ``upto``: the round whose clients file holds that state (the
        last one, up to ``upto``, that has the client). Only the files' headers are read."""
        index: dict[int, int] = {}
        for number in range(1, upto + 1):
            path = self.path(number)
            if path.is_file():
                index.update(dict.fromkeys(_clients_in(tensor_names(path)), number))
        return index

    def at(
        self, round_number: int, device: str | torch.device = "cpu", clients: Collection[int] | None = None
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Every client's state (or ``clients``') as it was after round ``round_number``, from the round files
        that hold them."""
        index = self.index(round_number)
        return self.read({k: n for k, n in index.items() if clients is None or k in clients}, device)

    def read(self, where: Mapping[int, int], device: str | torch.device = "cpu") -> dict[int, dict[str, torch.Tensor]]:
        """The states of the clients of ``where`` (client -> the round whose clients file holds its state), each
        file read once and only for those clients' tensors."""
        files: dict[int, set[int]] = {}
        for k, number in where.items():
            files.setdefault(number, set()).add(k)
        states: dict[int, dict[str, torch.Tensor]] = {}
        for number, ks in sorted(files.items()):
            stored = self.load(number, device, ks)
            states.update({k: stored[k] for k in ks})
        return dict(sorted(states.items()))

    def load(
        self, round_number: int, device: str | torch.device = "cpu", clients: Collection[int] | None = None
    ) -> dict[int, dict[str, torch.Tensor]]:
        """The states round ``round_number``'s clients file holds (only ``clients``', read alone, where given)."""
        path = self.path(round_number)
        if not path.is_file():
            return {}
        keep = None if clients is None else (lambda name: _client_of(name) in clients)
        states: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in load_tensors(path, device, keep).items():
            states.setdefault(_client_of(key), {})[key.split("/", 1)[1]] = tensor
        return states

    def server_path(self, round_number: int, *, kept: bool = False) -> Path:
        """What the server broadcasts besides the weights (SCAFFOLD's control variate) or, ``kept``, keeps to itself
        (FedGM's received sets), saved with the checkpoint."""
        suffix = "server-kept" if kept else "server"
        return self.run.checkpoints_dir / f"{_round_name(round_number)}-{suffix}.safetensors"

    def save_server(self, round_number: int, state: Mapping[str, torch.Tensor], *, kept: bool = False) -> None:
        tensors = tensors_bytes(state, {"round": str(round_number)})
        self.run.put(self.server_path(round_number, kept=kept), tensors)

    def load_server(
        self, round_number: int, device: str | torch.device = "cpu", *, kept: bool = False
    ) -> dict[str, torch.Tensor]:
        path = self.server_path(round_number, kept=kept)
        return load_tensors(path, device) if path.is_file() else {}


class WireStore(Store):
    """transmitted/: what each client sent in each round (``--save-transmitted``, and every canary run), for the
    audits of what crossed the wire."""

    def save(self, round_number: int, client_id: int, payload: Mapping[str, torch.Tensor]) -> None:
        path = self.run.transmitted_dir / _round_name(round_number) / f"client-{client_id:03d}.safetensors"
        self.run.put(path, tensors_bytes(payload, {"round": str(round_number), "client": str(client_id)}))

    def save_sum(self, round_number: int, clients: list[int], payload: Mapping[str, torch.Tensor]) -> None:
        """What ``clients`` sent, as the server received it under secure aggregation: added up."""
        path = self.run.transmitted_dir / _round_name(round_number) / SECURE_SUM_FILE
        meta = {"round": str(round_number), "clients": ",".join(str(k) for k in clients)}
        self.run.put(path, tensors_bytes(payload, meta))


class QueryStore(Store):
    """queries/: a canary run's query logs (fedaudit.instruments.queries), one file a round with every client's log."""

    def path(self, round_number: int) -> Path:
        return self.run.queries_dir / f"{_round_name(round_number)}.safetensors"

    def save(self, round_number: int, logs: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """One round's query logs, by client, in one file."""
        flat = {f"client-{k:03d}/{name}": t for k, log in sorted(logs.items()) for name, t in log.items()}
        self.run.put(self.path(round_number), tensors_bytes(flat, {"round": str(round_number)}))

    def load(self, round_number: int) -> dict[int, dict[str, torch.Tensor]]:
        """The query logs of one round by client; a round that wrote none is a :class:`RunError`."""
        logs: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in load_tensors(self.path(round_number)).items():
            client, _, name = key.partition("/")
            if not client.startswith("client-") or not client[7:].isdigit() or not name:
                raise RunError(f"{self.path(round_number)} holds an entry {key!r} that is not a query log.")
            logs.setdefault(int(client[7:]), {})[name] = tensor
        return logs


class AttackStore(Store):
    """attacks/: the results ``fedaudit attack`` writes (one directory each, metrics.json written last), which
    reports read."""

    def names(self) -> list[str]:
        """The attack result directories under attacks/ that hold a metrics.json (written last), sorted."""
        folder = self.run.attacks_dir
        return sorted(p.parent.name for p in folder.glob("*/metrics.json")) if folder.is_dir() else []

    def read(self, name: str) -> AttackRecord | None:
        """attacks/``name``/metrics.json as an :class:`AttackRecord`; None when it is not a JSON object.

        Raises:
            RunError: the file is missing, unreadable or not JSON, or a field is malformed.
        """
        data = self.run.read_json(self.run.attacks_dir / name / "metrics.json")
        return AttackRecord.from_dict(data, name) if isinstance(data, dict) else None

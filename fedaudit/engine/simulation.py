"""Flower engine: every client runs as a Flower ClientApp on a virtual SuperNode of Flower's simulation runtime (Ray),
on this machine or on an existing Ray cluster (``--ray-address``).

The round loop stays in :mod:`fedaudit.training`. This engine starts Flower's
simulation once per training session, in a background thread whose ServerApp
serves rounds as they come: :meth:`FlowerEngine.run_clients` sends each
selected client one Flower ``Message`` (the global model, what the client kept
from its last round, the round and the run's configuration) and turns the
replies back into :class:`ClientMessage` objects. A ClientApp rebuilds its
client's records from the configuration (dataset, partition and seed), so no
training data crosses the wire, and draws its randomness as the local engine's
client does: from the client's key, which the simulation's server sends with
each task (the simulated clients' secrets are in the run directory, which that
server holds), or from a public seed. The same keys give the same run on both.
A deployment's site never takes a key from the server (:func:`client_keys_for`).

Flower and Ray are the optional ``flower`` extra (``pip install 'fedaudit[flower]'``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedaudit.algorithms.base import Algorithm, ClientData, ClientMessage, RoundContext, TensorDict, run_client
from fedaudit.config import RunConfig
from fedaudit.errors import UserError
from fedaudit.privacy.accounting import SGMEvent
from fedaudit.privacy.randomness import (
    NOISE_SEED,
    ClientKeys,
    SecretKeys,
    SeededKeys,
    site_round_keys,
    site_secret_path,
)
from fedaudit.seeding import repeatable

if TYPE_CHECKING:
    from fedaudit.preparation import Setup

STARTUP_SECONDS = 300.0  # how long the simulation may take to bring up every SuperNode
CONNECT_SECONDS = 10.0  # how long a Ray cluster's head may take to accept a connection


class ClusterError(UserError):
    """A Ray cluster that cannot be reached (one sentence)."""


def reachable(address: str) -> None:
    """Refuse a ``--ray-address`` whose head accepts no connection: Ray would retry it for ever (every 30 s, and a
    Ctrl-C took 300 s to end the run). ``auto`` and addresses that name no port are left to Ray."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        raise ClusterError(
            f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc}); start one with "
            "'ray start --head' or give the address 'ray status' prints."
        ) from None


_STOPPED = object()


def _to_record(tensors: Mapping[str, torch.Tensor]) -> Any:
    """Tensors as a Flower ArrayRecord (NumPy arrays on the wire, names and order kept)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({name: Array(np.ascontiguousarray(t.detach().cpu().numpy())) for name, t in tensors.items()})


def _from_record(record: Any, device: torch.device | str) -> TensorDict:
    return {name: torch.from_numpy(array.numpy().copy()).to(device) for name, array in record.items()}


# ---------------------------------------------------------------------------- the ClientApp (runs in Ray actors)


@lru_cache(maxsize=4)
def _client_side(config_json: str) -> tuple[Setup, nn.Module]:
    """What a SuperNode needs to run clients of this run: its setup (config, algorithm, data, partition, canaries)
    and a scratch model."""
    from fedaudit.models import seeded_model
    from fedaudit.preparation import prepare

    setup = prepare(RunConfig.from_dict(json.loads(config_json)))
    return setup, seeded_model(setup.spec, 0).to(setup.device)  # its initial values are overwritten by the global model


@lru_cache(maxsize=16)
def _client_data(config_json: str, client: int) -> ClientData:
    from fedaudit.preparation import client_data

    setup, _ = _client_side(config_json)
    return client_data(setup, client)


@lru_cache(maxsize=4)
def read_own_site(config_json: str, client: int, site_data: str | None) -> Any:
    """A site's own records (:class:`fedaudit.data.sites.SiteData`), read, split and described as the run's seed
    and settings say; ``site_data`` is what the site's node config names."""
    from fedaudit.data.sites import read_site

    if not site_data:
        raise RuntimeError(
            f"this run's sites keep their records, but the SuperNode of client {client} names none: give it "
            "--node-config 'client-id=K data=\"npz:PATH\"'"
        )
    config = RunConfig.from_dict(json.loads(config_json))
    data = config.data
    return read_site(
        site_data,
        client,
        seed=config.seed,
        holdout_fraction=data.holdout_fraction,
        label_column=data.label_column,
        image_size=data.image_size,
    )


@lru_cache(maxsize=4)
def own_site(config_json: str, federation_json: str, client: int, site_data: str | None) -> tuple[Any, Any, Any]:
    """A site's view of the run (its setup, from the other sites' counts only: no other site's records or split), a
    scratch model, and its client's data built from its own records; refused when its records are not those it
    reported when the run began (the digest of its report, which the server sends)."""
    from fedaudit.data.sites import SiteReport
    from fedaudit.models import seeded_model
    from fedaudit.preparation import client_data, prepare

    told = [SiteReport.from_compact(item) for item in json.loads(federation_json)]
    reports = [report for report, _ in told]
    site = read_own_site(config_json, client, site_data)
    if SiteReport.of(site).digest() != told[client][1]:
        raise RuntimeError(
            f"the records of client {client}'s site are not those it reported when the run began (fingerprint "
            f"{site.fingerprint[:12]}, reported {reports[client].fingerprint[:12]})"
        )
    setup = prepare(RunConfig.from_dict(json.loads(config_json)), sites=reports)
    model = seeded_model(setup.spec, 0).to(setup.device)  # its initial values are overwritten by the global model
    members = torch.from_numpy(site.members)
    data = client_data(setup, client, (site.train_x[members], site.train_y[members]))
    return setup, model, data


def _query(message: Any, context: Any) -> Any:
    """Tell the server which client (partition) this SuperNode hosts."""
    from flwr.app import ConfigRecord, Message, RecordDict

    partition = int(context.node_config["partition-id"])
    return Message(content=RecordDict({"node": ConfigRecord({"client": partition})}), reply_to=message)


def _train(message: Any, context: Any) -> Any:
    """One client round on a simulated SuperNode (its node config names the client as ``partition-id``)."""
    return client_round(message, int(context.node_config["partition-id"]))


@dataclass(frozen=True)
class SiteSecret:
    """What a deployment's site decides for itself: where it keeps its client's secret (its node config's
    ``secret``, else its ``data-dir``), whether it lets the server choose a public noise seed (``public-noise=true``:
    for experiments only), and the least noise multiplier it accepts (``min-noise-multiplier``; None: whatever DP
    settings the run has)."""

    named: str | None
    data_dir: str | None
    public_noise: bool = False
    min_noise_multiplier: float | None = None

    def path(self, client: int) -> Path:
        """The secret's file (a :class:`SecretError` when the node config names no place for it)."""
        return site_secret_path(client, self.named, self.data_dir)


def round_inputs(task: Any, tensors: Sequence[Mapping[str, torch.Tensor]]) -> str:
    """SHA-256 of everything a client's answer to a round depends on: the run's settings (not how fast it runs or
    whose runtime: engine, parallel clients, Flower's and the data directory's settings; the device only by its kind,
    since a CUDA generator draws other values than a CPU one from the same key), the round, the rounds, what the
    sites reported, and the tensors sent (global model, kept state, server state)."""
    settings = json.loads(str(task["config"]))
    for key in ("engine", "parallel_clients", "flower"):
        settings.pop(key, None)
    settings["device"] = str(settings.get("device", "cpu")).split(":")[0]
    settings.get("data", {}).pop("data_dir", None)
    described = [settings, int(task["round"]), int(task["rounds"]), str(task.get("federation", ""))]
    if int(task.get("participants", 0)):  # the noise share of a client-level round depends on it
        described.append(int(task["participants"]))
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode())
    for group in tensors:
        for name in sorted(group):
            array = np.ascontiguousarray(group[name].detach().cpu().numpy())
            digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def client_keys_for(
    task: Any, config: RunConfig, client: int, site: SiteSecret | None, inputs: str | None = None
) -> ClientKeys:
    """Where this client's draws come from in this round: a public seed for a run without DP randomness (the run
    seed) or with ``--noise-seed``; else its secret's keys: in a simulation the key the server sent (the simulated
    clients' secrets are the run directory's), at a deployment's site its own secret, which never leaves it, for a
    round it answers once (``inputs``: :func:`round_inputs`).

    A site refuses a key sent by the server, a public noise seed unless its node config allows one (either would let
    the server regenerate and remove the site's noise), a second request for a round with other inputs, and a run
    with less noise than its node config's ``min-noise-multiplier``.
    """
    priv = config.privacy
    secure = bool(priv.secure_noise)
    if site is not None and "key" in task:
        raise RuntimeError(
            f"the server sent client {client} a key for its noise; a site draws its noise from its own secret only"
        )
    least = None if site is None else site.min_noise_multiplier
    if least is not None and not (priv.record_level and (priv.noise_multiplier or 0.0) >= least):
        sigma = f"noise multiplier {priv.noise_multiplier:g}" if priv.record_level else "no DP"
        if priv.client_level:
            sigma = "client-level DP (its update sent in clear, the noise added by the server)"
        raise RuntimeError(
            f"the server asks client {client} for a round with {sigma}, and its site accepts no less than {least:g} "
            "(min-noise-multiplier in its --node-config)"
        )
    if not config.dp_randomness:
        return SeededKeys(config.seed, client)
    if priv.noise_seed is not None:
        if site is not None and not site.public_noise:
            raise RuntimeError(
                f"the server asks client {client} to draw its noise from a public seed (--noise-seed), which would let "
                "the server remove it; start the site's SuperNode with public-noise=true in its --node-config to "
                "allow that for experiments"
            )
        return SeededKeys(priv.noise_seed, client, secure=secure, source=NOISE_SEED)
    if site is None:
        if "key" not in task:
            raise RuntimeError(f"the simulation's server sent client {client} no key for its noise")
        return SecretKeys(bytes.fromhex(str(task["key"])), secure=secure)
    if inputs is None:
        raise RuntimeError("a site's keys are for one round's inputs: give round_inputs")
    return site_round_keys(site.path(client), str(task["run"]), client, int(task["round"]), inputs, secure=secure)


def client_round(
    message: Any,
    hosted: int,
    data_dir: str | None = None,
    site_data: str | None = None,
    site: SiteSecret | None = None,
) -> Any:
    """One client round: the same ``client_update`` as the local engine, with the client's own keys.

    ``hosted`` is the client this SuperNode serves; ``data_dir`` replaces the run's data directory (a site's own);
    ``site_data`` is the site's own records in a federation whose sites keep them (the task then carries what the
    sites reported, instead of the site rebuilding the partition); ``site`` is a deployment's site's secret (None in
    a simulation).
    """
    from flwr.app import ConfigRecord, Message, RecordDict

    task = message.content["task"]
    config_json, client, round_index = (
        site_config(str(task["config"]), data_dir),
        int(task["client"]),
        int(task["round"]),
    )
    if client != hosted:
        raise RuntimeError(f"SuperNode of client {hosted} was sent client {client}'s work.")
    if "federation" in task:
        setup, model, data = own_site(config_json, str(task["federation"]), client, site_data)
    else:
        setup, model = _client_side(config_json)
        data = _client_data(config_json, client)
    config, algorithm, device = setup.config, setup.algorithm, setup.device
    repeatable(device)
    names = [name for name, _ in model.named_parameters()]
    received = _from_record(message.content["global"], device)
    global_params = {name: received[name] for name in names}  # the model's order fixes the order of float sums
    state = _from_record(message.content["state"], device) if "state" in message.content else None
    server_state = _from_record(message.content["server"], device) if "server" in message.content else {}
    inputs = None if site is None else round_inputs(task, [received, state or {}, server_state])
    keys = client_keys_for(task, config, client, site, inputs)
    ctx = RoundContext(
        round=round_index,
        rounds=int(task["rounds"]),
        config=config,
        device=device,
        server_state=server_state,
        run_id=str(task["run"]),
        participants=int(task.get("participants", 0)),
    )
    result = run_client(algorithm, model, global_params, data, ctx, keys, state=state)
    content = {
        "payload": _to_record(result.payload),
        "info": ConfigRecord(
            {
                "client": result.client_id,
                "num_examples": result.num_examples,
                "metrics": json.dumps(result.metrics),
                "events": json.dumps([event.to_dict() for event in result.privacy_events]),
                "fingerprint": setup.sites[client].fingerprint if setup.sites else setup.dataset.fingerprint,
            }
        ),
    }
    if result.state:
        content["state"] = _to_record(result.state)
    if result.audit:
        content["audit"] = _to_record(result.audit)
    return Message(content=RecordDict(content), reply_to=message)


def site_config(config_json: str, data_dir: str | None) -> str:
    """The run's configuration as a site sees it: with the site's own data directory, when it names one."""
    if data_dir is None:
        return config_json
    config = json.loads(config_json)
    config["data"]["data_dir"] = data_dir
    return json.dumps(config, sort_keys=True)


def train_message(
    config_json: str,
    global_params: TensorDict,
    data: ClientData,
    ctx: RoundContext,
    state: TensorDict | None,
    node: int,
    federation: str | None = None,
    key: bytes | None = None,
) -> Any:
    """The Flower message that asks the SuperNode ``node`` for one round of client ``data.client_id``;
    ``federation`` is what the sites reported of their records, where they keep them; ``key`` is a simulated
    client's key (never a deployment site's: a site holds its own)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    task = {
        "config": config_json,
        "client": data.client_id,
        "round": ctx.round,
        "rounds": ctx.rounds,
        "run": ctx.run_id,
    }
    if ctx.participants:
        task["participants"] = ctx.participants
    if federation is not None:
        task["federation"] = federation
    if key is not None:
        task["key"] = key.hex()
    content = {"global": _to_record(global_params), "task": ConfigRecord(task)}
    if state is not None:
        content["state"] = _to_record(state)
    if ctx.server_state:
        content["server"] = _to_record(ctx.server_state)
    return Message(content=RecordDict(content), message_type="train", dst_node_id=node)


def client_message(reply: Any, device: torch.device) -> ClientMessage:
    """The :class:`ClientMessage` that a client's reply carries (its payload empty where the server received it
    only inside a secure sum)."""
    info = reply.content["info"]
    return ClientMessage(
        client_id=int(info["client"]),
        num_examples=int(info["num_examples"]),
        payload=_from_record(reply.content["payload"], device) if "payload" in reply.content else {},
        metrics={k: float(v) for k, v in json.loads(str(info["metrics"])).items()},
        privacy_events=[SGMEvent.from_dict(e) for e in json.loads(str(info["events"]))],
        state=_from_record(reply.content["state"], device) if "state" in reply.content else {},
        audit=_from_record(reply.content["audit"], "cpu") if "audit" in reply.content else {},
    )


def _client_app() -> Any:
    from flwr.clientapp import ClientApp

    app = ClientApp()
    app.query()(_query)
    app.train()(_train)
    return app


# ---------------------------------------------------------------------------- the engine (server side)


class FlowerEngine:
    """Runs the selected clients of each round on Flower's simulation runtime, one SuperNode per client."""

    name = "flower"

    def __init__(self, config: RunConfig, *, num_clients: int) -> None:
        data_dir = config.data.data_dir
        if data_dir is not None:  # Ray workers do not share the caller's working directory
            config = replace(config, data=replace(config.data, data_dir=str(Path(data_dir).resolve())))
        self.config_json = json.dumps(config.to_dict(), sort_keys=True)
        self.device = config.device
        self.settings = config.flower
        self.num_clients = num_clients
        self._requests: queue.Queue[Any] = queue.Queue()
        self._replies: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._node_of: dict[int, int] = {}

    def __enter__(self) -> FlowerEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def take_secure_sum(self) -> None:
        """A simulation's payloads come on their own (its server is the simulator: no secure aggregation)."""
        return None

    def run_clients(
        self,
        algorithm: Algorithm,
        model: nn.Module,
        global_params: TensorDict,
        clients: Sequence[ClientData],
        ctx: RoundContext,
        client_keys: Callable[[int], ClientKeys],
        states: Mapping[int, TensorDict],
    ) -> list[ClientMessage]:
        """Send each selected client its round (with its key, where it draws from a secret) and wait for every
        reply; a client's failure is raised here."""
        if self._thread is None:
            self._start()
        requests = []
        for data in clients:
            keys = client_keys(data.client_id)
            key = keys.key if isinstance(keys, SecretKeys) else None
            node = self._node_of[data.client_id]
            requests.append(
                train_message(self.config_json, global_params, data, ctx, states.get(data.client_id), node, key=key)
            )
        self._requests.put(requests)
        replies = self._receive()
        messages = {}
        for reply in replies:
            if reply.has_error():
                raise RuntimeError(f"A client failed on Flower: {reply.error.reason}")
            message = client_message(reply, ctx.device)
            messages[message.client_id] = message
        missing = [data.client_id for data in clients if data.client_id not in messages]
        if missing:
            raise RuntimeError(f"Flower returned no reply from client {missing[0]}.")
        return [messages[data.client_id] for data in clients]

    def close(self) -> None:
        """End the simulation (its ServerApp returns) and wait for its thread."""
        if self._thread is not None and self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=STARTUP_SECONDS)
        self._thread = None

    def _start(self) -> None:
        from flwr.serverapp import ServerApp

        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        logging.getLogger("flwr").setLevel(logging.ERROR)
        server_app = ServerApp()
        server_app.main()(lambda grid, context: self._serve(grid))
        settings = self.settings
        gpus = settings.client_gpus
        if gpus is None:
            cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
            gpus = 1.0 / self.num_clients if cuda else 0.0
        init_args: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
        if settings.ray_address is None:  # a new Ray instance of this machine for this run, even if a cluster runs here
            init_args.update(address="local", num_cpus=max(1, os.cpu_count() or 1))
        else:  # an existing cluster: its nodes bring their own CPUs and GPUs
            reachable(settings.ray_address)
            init_args["address"] = settings.ray_address
        backend = {
            "client_resources": {"num_cpus": float(settings.client_cpus), "num_gpus": float(gpus)},
            "init_args": init_args,
        }
        self._thread = threading.Thread(
            target=self._simulate, args=(server_app, backend), name="flower-simulation", daemon=True
        )
        self._thread.start()
        self._node_of = self._receive()

    def _simulate(self, server_app: Any, backend: dict[str, Any]) -> None:
        from flwr.simulation import run_simulation

        try:
            run_simulation(
                server_app=server_app, client_app=_client_app(), num_supernodes=self.num_clients, backend_config=backend
            )
        except BaseException as exc:  # handed to the training thread, which raises it
            self._replies.put(exc)
        finally:
            self._replies.put(_STOPPED)

    def _serve(self, grid: Any) -> None:
        """The ServerApp: learn which SuperNode hosts which client, then carry out rounds until told to stop."""
        from flwr.app import Message, RecordDict

        deadline = time.monotonic() + STARTUP_SECONDS
        nodes = list(grid.get_node_ids())
        while len(nodes) < self.num_clients:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Flower brought up {len(nodes)} of {self.num_clients} SuperNodes in time.")
            time.sleep(0.1)
            nodes = list(grid.get_node_ids())
        hello = grid.send_and_receive(
            [Message(content=RecordDict(), message_type="query", dst_node_id=n) for n in nodes]
        )
        self._replies.put({int(r.content["node"]["client"]): r.metadata.src_node_id for r in hello})
        while (request := self._requests.get()) is not None:
            self._replies.put(list(grid.send_and_receive(request)))

    def _receive(self) -> Any:
        """The next answer of the simulation thread; its failure or early end is raised here."""
        item = self._replies.get()
        if item is _STOPPED:
            raise RuntimeError("Flower's simulation ended before the training did.")
        if isinstance(item, BaseException):
            raise RuntimeError(f"Flower's simulation failed: {item}") from item
        return item

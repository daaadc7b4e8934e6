"""Flower's deployment runtime: each client runs on a SuperNode at its own site, the fedaudit process is the server.

A user starts a SuperLink (``flower-superlink --isolation process``), one SuperNode per site whose node config
names its client (``--node-config 'client-id=0 data-dir="/site/data"'``), and ``fedaudit train --engine flower
--superlink HOST:PORT --root-certificates ca.crt``. This engine then does what ``flwr run`` and Flower's
ServerApp process would do, inside the training process, so the round loop, run directory, ledger,
checkpoints and audit stay exactly those of the local engine:

1. submit a run to the SuperLink (a FAB holding only a ``pyproject.toml``: the ClientApp is this module's
   :data:`client_app`, imported from the fedaudit installed at each site), claim its ServerApp task and keep it
   alive with a heartbeat;
2. wait until every client's SuperNode is connected, and ask each which client it hosts and which records it
   holds (their indices in the dataset and the data's fingerprint: no record leaves a site). A client claimed by
   two SuperNodes, or a site whose records are not the run's partition, is refused;
3. each round, send the selected clients the global model and what they kept, and turn the replies back into
   client messages. A site that dies (no heartbeat for a minute) or does not answer within ``round_timeout``
   ends the round with one sentence naming it; nothing of that round is committed, so ``--resume`` continues
   once the site is back. A site whose data fingerprint changes during the run is refused. With the noise of
   client-level DP in shares (``--noise-at clients``), a round's results are summed under Flower's SecAgg+
   (fedaudit.engine.secure_sum), and a server that follows the protocol receives and keeps their sum alone.

Every site computes exactly what the local engine's client computes (the same ``client_update``), with its draws
from a secret that only the site holds: a file the site creates (mode 0600) where its node config says (``secret``)
or in its data directory, never sent to the server. So the server cannot regenerate a site's noise or Poisson
samples. With ``--noise-seed`` (sites that allow it: ``public-noise=true``) the run is the local engine's, byte for
byte. The Flower APIs used for step 1 are internal ones of
Flower 1.42 (the ``flower`` extra pins it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedaudit.algorithms.base import (
    SECURE_SUM,
    Algorithm,
    ClientData,
    ClientMessage,
    RoundContext,
    TensorDict,
    evaluation_counts,
    load_params,
)
from fedaudit.config import RunConfig, secure_aggregation
from fedaudit.data.sites import SiteReport, is_sites, recorded_hashes, sites_fingerprint
from fedaudit.engine.secure_sum import (
    SecureRoundError,
    as_fit_result,
    clipping_range,
    is_secure,
    secure_round,
    secure_sum_mod,
)
from fedaudit.engine.simulation import (
    SiteSecret,
    _client_side,
    _from_record,
    _to_record,
    client_message,
    client_round,
    own_site,
    read_own_site,
    site_config,
    train_message,
)
from fedaudit.errors import UserError
from fedaudit.privacy.randomness import ClientKeys

ACQUIRE_SECONDS = 20.0  # how long the SuperLink may take to hand this process its run's ServerApp task
POLL_SECONDS = 0.2
NODE_UNAVAILABLE = 5  # flwr.common.constant.ErrorCode.NODE_UNAVAILABLE

PYPROJECT = b"""[project]
name = "fedaudit-deployment"
version = "1.0.0"
description = "fedaudit clients on Flower SuperNodes (the ClientApp comes from the fedaudit installed at each site)"

[tool.flwr.app]
publisher = "fedaudit"

[tool.flwr.app.components]
serverapp = "fedaudit.engine.deployment:server_app"
clientapp = "fedaudit.engine.deployment:client_app"

[tool.flwr.app.config]
"""


class DeploymentError(UserError):
    """The federation cannot carry the run (a site missing, dead, duplicated or holding other data)."""


# ---------------------------------------------------------------------------- the ClientApp (runs at each site)


def _site(context: Any) -> tuple[int, str | None, str | None]:
    """The client this SuperNode hosts, and the data directory and own data (``data``) its node config names."""
    node = context.node_config
    if "client-id" not in node:
        raise RuntimeError("this SuperNode has no client-id in its --node-config, so it hosts no fedaudit client")
    data_dir, data = node.get("data-dir"), node.get("data")
    return (
        int(node["client-id"]),
        None if data_dir in (None, "") else str(data_dir),
        None if data in (None, "") else str(data),
    )


def _hello(message: Any, context: Any) -> Any:
    """Which client this site hosts and which records it holds: indices into the dataset and its fingerprint, or,
    where the sites keep their records, its report of them (counts, positions, hashes: no record)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

    client, data_dir, data = _site(context)
    config_json = site_config(str(message.content["task"]["config"]), data_dir)
    if is_sites(json.loads(config_json)["data"]["dataset"]):
        report = SiteReport.of(read_own_site(config_json, client, data))
        content = {
            "site": ConfigRecord(
                {"client": client, "fingerprint": report.fingerprint, "report": json.dumps(report.summary())}
            ),
            "records": ArrayRecord(
                {
                    "member_hashes": Array(np.ascontiguousarray(report.member_hashes)),
                    "heldout_hashes": Array(np.ascontiguousarray(report.heldout_hashes)),
                }
            ),
        }
        return Message(content=RecordDict(content), reply_to=message)
    setup, _ = _client_side(config_json)
    records = (
        np.asarray(setup.partition.clients[client], dtype=np.int64) if client < len(setup.partition.clients) else None
    )
    content = {"site": ConfigRecord({"client": client, "fingerprint": setup.dataset.fingerprint})}
    if records is not None:
        content["records"] = ArrayRecord({"index": Array(np.ascontiguousarray(records))})
    return Message(content=RecordDict(content), reply_to=message)


def _secret(context: Any, client: int, data_dir: str | None) -> SiteSecret:
    """What this site decides for itself (node config): where it keeps its client's secret (``secret``, else its
    ``data-dir``), whether it lets the server choose a public noise seed (``public-noise=true``), and the least noise
    multiplier it accepts (``min-noise-multiplier``)."""
    node = context.node_config
    named = node.get("secret")
    allowed = node.get("public-noise", False)
    least = node.get("min-noise-multiplier")
    try:
        floor = None if least in (None, "") else float(least)
    except (TypeError, ValueError):
        raise RuntimeError(f"this SuperNode's min-noise-multiplier {least!r} is not a number") from None
    return SiteSecret(
        None if named in (None, "") else str(named),
        data_dir,
        public_noise=allowed is True or str(allowed).strip().lower() == "true",
        min_noise_multiplier=floor,
    )


def _train(message: Any, context: Any) -> Any:
    """One round of this site's client; under secure aggregation, its reply as SecAgg+'s mod masks it."""
    client, data_dir, data = _site(context)
    secure = is_secure(message)
    if not secure:
        _no_share_in_clear(message.content["task"])
    reply = client_round(message, client, data_dir, data, site=_secret(context, client, data_dir))
    return as_fit_result(reply, message) if secure else reply


def error_reason(error: Any) -> str:
    """A ClientApp's error as its own sentence, without Flower's wrapper ("<class 'RuntimeError'>:<'...'>") and
    without a closing full stop (the caller's sentence ends it)."""
    reason = re.sub(r"^<class '[\w.]+'>:<'(.*)'>$", r"\1", str(error.reason).strip(), flags=re.DOTALL)
    return reason.rstrip(".")


def _no_share_in_clear(task: Any) -> None:
    """A site adding its share of client-level noise sends it in clear only when its share is the whole noise (a round
    of one participant: sigma C / sqrt(1)); asked for it in clear otherwise (a server that skipped the secure sum, by
    fault or on purpose, whatever number of sites it says the round has), it refuses. The share's size comes from
    the participants the task names, so this is the number that must be 1, not the sites the server says it asked."""
    privacy = json.loads(str(task["config"]))["privacy"]
    if privacy.get("dp_level") == "client" and privacy.get("noise_at") == "clients":
        if int(task.get("participants", 0)) != 1 or int(task.get("sites", 1)) != 1:
            raise RuntimeError(
                "this site adds its share of the noise for a sum under SecAgg+, and the server asked for it in clear"
            )


def _evaluate(message: Any, context: Any) -> Any:
    """The model's quality on this site's own test records: how many it classifies right, the summed loss, how many
    there are (where the sites keep their records, the server has none to evaluate on)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    client, data_dir, data = _site(context)
    task = message.content["task"]
    config_json = site_config(str(task["config"]), data_dir)
    setup, model, _ = own_site(config_json, str(task["federation"]), client, data)
    site = read_own_site(config_json, client, data)
    names = [name for name, _ in model.named_parameters()]
    received = _from_record(message.content["global"], setup.device)
    params = {name: received[name] for name in names}
    correct, loss, count = evaluation_counts(model, params, site.test_x.to(setup.device), site.test_y.to(setup.device))
    scores = ConfigRecord({"client": client, "correct": correct, "loss": loss, "count": count})
    return Message(content=RecordDict({"scores": scores}), reply_to=message)


def _signals(message: Any, context: Any) -> Any:
    """The membership signals of this site's records at the positions asked for, on the model sent: the audit
    computed where the data is. Only the signals and the records' hashes leave the site."""
    from flwr.app import Array, ArrayRecord, Message, RecordDict

    from fedaudit.instruments.record_signals import compute_signals

    client, data_dir, data = _site(context)
    task = message.content["task"]
    config_json = site_config(str(task["config"]), data_dir)
    setup, model, _ = own_site(config_json, str(task["federation"]), client, data)
    site = read_own_site(config_json, client, data)
    positions = message.content["positions"]["positions"].numpy().astype(np.int64)
    if len(positions) and (positions.min() < 0 or positions.max() >= len(site.train_y)):
        raise RuntimeError(f"client {client}'s site was asked for records it does not have")
    received = _from_record(message.content["global"], setup.device)
    load_params(model, {name: received[name] for name, _ in model.named_parameters()})
    index = torch.from_numpy(positions)
    found = compute_signals(
        model,
        site.train_x[index],
        site.train_y[index],
        json.loads(str(task["signals"])),
        per_layer=bool(task["per_layer"]),
        batch_size=int(task["batch_size"]),
        device=setup.device,
    )
    arrays = {name: Array(np.ascontiguousarray(v)) for name, v in {**found.values, **found.per_layer}.items()}
    arrays["hashes"] = Array(np.ascontiguousarray(site.hashes[positions]))
    return Message(content=RecordDict({"signals": ArrayRecord(arrays)}), reply_to=message)


def _make_client_app() -> Any:
    from flwr.clientapp import ClientApp

    app = ClientApp(mods=[secure_sum_mod])
    app.query()(_hello)
    app.query("signals")(_signals)
    app.train()(_train)
    app.evaluate()(_evaluate)
    return app


def _make_server_app() -> Any:
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Any, context: Any) -> None:  # the fedaudit process is the server; this one is never started
        raise RuntimeError("fedaudit's deployment runs need the SuperLink started with --isolation process")

    return app


def __getattr__(name: str) -> Any:
    """``client_app`` / ``server_app`` for Flower's component loader, built on first use (Flower imports lazily)."""
    if name == "client_app":
        return _make_client_app()
    if name == "server_app":
        return _make_server_app()
    raise AttributeError(name)


# ---------------------------------------------------------------------------- the engine (server side)


class SiteMap:
    """Which SuperNode hosts each client, and what its site holds: asked of every SuperNode when a session begins
    (each site must hold the records the run's partition gives its client, or, for sites that keep their records,
    those it reported when the run began; a survey only takes the reports)."""

    def __init__(
        self, num_clients: int, membership: Sequence[np.ndarray], sites: Sequence[SiteReport], *, survey: bool
    ) -> None:
        self.num_clients = num_clients
        self.membership = [np.asarray(m, dtype=np.int64) for m in membership]
        self.sites = list(sites)
        self.survey = survey
        self.node_of: dict[int, int] = {}
        self.fingerprint: dict[int, str] = {}
        self.reports: dict[int, SiteReport] = {}  # what the sites that keep their records reported

    def ask(self, grid: Any, config_json: str, wait_seconds: float, address: str) -> None:
        """Ask every SuperNode which client it hosts as soon as it connects (SuperNodes that connect while others
        are still answering are asked at once, not after them), until each client has one and every node asked has
        answered (or the wait is over). A node that went away meanwhile (a dead site's stale entry) is left out."""
        from flwr.app import ConfigRecord, Message, RecordDict

        deadline = time.monotonic() + wait_seconds
        task = ConfigRecord({"config": config_json})
        asked: set[int] = set()
        pending: dict[str, int] = {}  # message id -> node
        claims: dict[int, list[int]] = {}
        while True:
            nodes = [] if self.mapped() else [n for n in grid.get_node_ids() if n not in asked]
            if nodes:
                asked.update(nodes)
                hellos = [Message(RecordDict({"task": task}), message_type="query", dst_node_id=n) for n in nodes]
                pending.update(zip(grid.push_messages(hellos), nodes))
            if pending:
                for reply in grid.pull_messages(list(pending)):
                    node = pending.pop(reply.metadata.reply_to_message_id)
                    if reply.has_error():
                        if int(reply.error.code) == NODE_UNAVAILABLE:
                            continue
                        raise DeploymentError(
                            f"The SuperNode {node} could not say which client it hosts: {error_reason(reply.error)}."
                        )
                    self._check_site(node, reply, claims)
            late = time.monotonic() > deadline
            if self.mapped() and (not pending or late):
                return
            if late:
                missing = [client for client in range(self.num_clients) if client not in self.node_of]
                raise DeploymentError(
                    f"No SuperNode hosts client {missing[0]} after {wait_seconds:g} s ({len(self.node_of)} of "
                    f"{self.num_clients} clients connected to {address}); start one with --node-config "
                    f"'client-id={missing[0]}'."
                )
            time.sleep(POLL_SECONDS)

    def mapped(self) -> bool:
        """Whether every client has a SuperNode."""
        return all(client in self.node_of for client in range(self.num_clients))

    def _check_site(self, node: int, reply: Any, claims: dict[int, list[int]]) -> None:
        site = reply.content["site"]
        client = int(site["client"])
        if not 0 <= client < self.num_clients:
            raise DeploymentError(
                f"The SuperNode {node} hosts client {client}, but this run has clients 0 to {self.num_clients - 1}."
            )
        claims.setdefault(client, []).append(node)
        if len(claims[client]) > 1:
            first, second = claims[client][:2]
            raise DeploymentError(
                f"Two SuperNodes claim client {client} (nodes {first} and {second}); give each site its own client-id."
            )
        if "report" in site:
            self._check_report(node, client, reply)
            return
        records = reply.content["records"]["index"].numpy() if "records" in reply.content else None
        if records is None or not np.array_equal(records, self.membership[client]):
            raise DeploymentError(
                f"The site of client {client} (node {node}) holds other records than the run's partition gives "
                f"client {client}; it must use the same dataset, seed and partition settings."
            )
        self.node_of[client] = node
        self.fingerprint[client] = str(site["fingerprint"])

    def _check_report(self, node: int, client: int, reply: Any) -> None:
        """A site that keeps its records: its report is taken (a survey) or must be the one it gave when the run
        began (its records, their split and their hashes unchanged)."""
        report = SiteReport.from_summary(json.loads(str(reply.content["site"]["report"])))
        hashes = reply.content["records"]
        report = replace(
            report,
            member_hashes=hashes["member_hashes"].numpy().copy(),
            heldout_hashes=hashes["heldout_hashes"].numpy().copy(),
        )
        if report.client != client:
            raise DeploymentError(f"The SuperNode {node} reported client {report.client}'s records as client {client}.")
        if not self.survey:
            before = self.sites[client]
            same = report.summary() == before.summary() and all(
                np.array_equal(getattr(report, name), getattr(before, name))
                for name in ("member_hashes", "heldout_hashes")
            )
            if not same:
                raise DeploymentError(
                    f"The site of client {client} (node {node}) holds other records than when the run began "
                    f"(fingerprint {report.fingerprint[:12]}, was {before.fingerprint[:12]}); put its data back."
                )
        self.reports[client] = report
        self.node_of[client] = node
        self.fingerprint[client] = report.fingerprint


class DeploymentEngine:
    """Runs the selected clients of each round on their sites' SuperNodes, through a SuperLink."""

    name = "flower"

    def __init__(
        self,
        config: RunConfig,
        *,
        num_clients: int,
        membership: Sequence[np.ndarray],
        sites: Sequence[SiteReport] = (),
        survey: bool = False,
    ) -> None:
        """``sites``: what the sites that keep their records reported when the run began (each must still hold
        those); ``survey``: only ask every site for its report (:func:`survey_sites`)."""
        dep = config.flower
        self.config_json = _config_json(config)
        self.address = str(dep.superlink)
        self.insecure = bool(dep.insecure)
        self.certificates = None if dep.root_certificates is None else Path(dep.root_certificates).read_bytes()
        self.wait_seconds = float(dep.wait_seconds)
        self.round_timeout = float(dep.round_timeout)
        self.window = config.parallel_clients  # at most this many sites at work at once; None: all of a round's
        self.secure = secure_aggregation(config)  # two or more sites a round: their payloads summed under SecAgg+
        self.clip = (config.privacy.max_update_norm, config.privacy.noise_multiplier)  # C and sigma: SecAgg+'s range
        self._summed: ClientMessage | None = None
        self.num_clients = num_clients
        self.site_map = SiteMap(num_clients, membership, sites, survey=survey)
        self._grid: Any = None
        self._control: Any = None
        self._context: Any = None
        self._heartbeat: Any = None
        self._task_alive = True
        self._ok = False
        self.federation = json.dumps([report.compact() for report in sites]) if sites else None

    def __enter__(self) -> DeploymentEngine:
        return self

    def take_secure_sum(self) -> ClientMessage | None:
        """The last round's secure sum; None where its payloads came on their own (no shares, or one site)."""
        summed, self._summed = self._summed, None
        return summed

    def __exit__(self, *exc: object) -> None:
        self.close(completed=exc[0] is None)

    # -- rounds

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
        """Send each selected client its round and wait for every reply; a dead, silent or changed site is raised.
        ``client_keys`` is never called: each site draws from its own secret, which the server does not hold."""
        if self._grid is None:
            self._start()
        requests = {
            data.client_id: train_message(
                self.config_json,
                global_params,
                data,
                ctx,
                states.get(data.client_id),
                self.site_map.node_of[data.client_id],
                self.federation,
            )
            for data in clients
        }
        for request in requests.values():  # a site sends its share in clear only with no other site to sum it with
            request.content["task"]["sites"] = len(requests)
        if self.secure and len(requests) >= 2:
            replies = self._secure_exchange(requests, ctx, global_params)
        else:
            replies = self._exchange(requests, ctx.round + 1, time.monotonic() + self.round_timeout)
        messages = []
        for data in clients:
            reply = replies[data.client_id]
            fingerprint = str(reply.content["info"]["fingerprint"])
            known = self.site_map.fingerprint[data.client_id]
            if fingerprint != known:
                raise DeploymentError(
                    f"The data at client {data.client_id}'s site changed during the run (fingerprint "
                    f"{fingerprint[:12]}, was {known[:12]}); put its data back and resume."
                )
            messages.append(client_message(reply, ctx.device))
        return messages

    def evaluate_at_sites(self, params: TensorDict, round_number: int) -> tuple[float, float]:
        """Accuracy and mean loss of the model on every site's own test records: each site counts on its own, the
        counts are added in client order (as the local engine adds them)."""
        from flwr.app import ConfigRecord, Message, RecordDict

        if self._grid is None:
            self._start()
        requests = {
            client: Message(
                RecordDict(
                    {
                        "global": _to_record(params),
                        "task": ConfigRecord(
                            {"config": self.config_json, "client": client, "federation": str(self.federation)}
                        ),
                    }
                ),
                message_type="evaluate",
                dst_node_id=self.site_map.node_of[client],
            )
            for client in range(self.num_clients)
        }
        replies = self._exchange(requests, round_number, time.monotonic() + self.round_timeout)
        correct, loss, count = 0, 0.0, 0
        for client in range(self.num_clients):
            scores = replies[client].content["scores"]
            correct, loss, count = (
                correct + int(scores["correct"]),
                loss + float(scores["loss"]),
                count + int(scores["count"]),
            )
        return correct / count, loss / count

    def _exchange(self, requests: dict[int, Any], round_number: int, deadline: float) -> dict[int, Any]:
        """Push one message per client (at most ``window`` outstanding at once, the next one as soon as a reply
        comes) and pull until every client answered; failures are one sentence each."""
        queue = list(requests)
        window = len(queue) if self.window is None else self.window
        sent: dict[str, int] = {}  # message id -> client
        replies: dict[int, Any] = {}
        while len(replies) < len(requests):
            if not self._task_alive:
                raise DeploymentError(f"The SuperLink at {self.address} ended this run (its heartbeat was refused).")
            room = window - (len(sent) - len(replies))
            if room > 0 and queue:
                batch, queue = queue[:room], queue[room:]
                sent.update(zip(self._grid.push_messages([requests[client] for client in batch]), batch))
            waiting = [mid for mid, client in sent.items() if client not in replies]
            for reply in self._grid.pull_messages(waiting):
                client = sent[reply.metadata.reply_to_message_id]
                if reply.has_error():
                    raise DeploymentError(self._failure(client, round_number, reply.error))
                replies[client] = reply
            if len(replies) < len(requests):
                if time.monotonic() > deadline:
                    silent = sorted(client for client in sent.values() if client not in replies)
                    raise DeploymentError(
                        f"Client {silent[0]}'s site did not answer round {round_number} within "
                        f"{self.round_timeout:g} s; check its SuperNode and resume the run."
                    )
                time.sleep(POLL_SECONDS)
        return replies

    def _secure_exchange(self, requests: dict[int, Any], ctx: RoundContext, params: TensorDict) -> dict[int, Any]:
        """The round under SecAgg+ (fedaudit.engine.secure_sum): every site at once, whatever the window; each
        reply without its payload, and the payloads' sum kept for :meth:`take_secure_sum`."""
        round_number = ctx.round + 1
        client_of = {self.site_map.node_of[client]: client for client in requests}
        try:
            by_node, total = secure_round(
                self._grid,
                self._context,
                {node: requests[client] for node, client in client_of.items()},
                round_number=round_number,
                like=params,
                clip_range=clipping_range(*self.clip, ctx.participants),
                timeout=self.round_timeout,
                poll=POLL_SECONDS,
                alive=lambda: self._task_alive,
            )
        except SecureRoundError as exc:
            client = client_of.get(exc.node, min(requests))
            raise _secure_failure(exc, client, round_number, self) from None
        self._summed = ClientMessage(client_id=SECURE_SUM, num_examples=len(by_node), payload=total)
        return {client_of[node]: reply for node, reply in by_node.items()}

    def _failure(self, client: int, round_number: int, error: Any) -> str:
        node = self.site_map.node_of.get(client)
        if int(error.code) == NODE_UNAVAILABLE:
            return (
                f"The SuperNode of client {client} (node {node}) stopped answering in round {round_number}: it sent no "
                "heartbeat for a minute. Restart it and continue with fedaudit train --resume RUN."
            )
        return f"Client {client}'s ClientApp (node {node}) failed in round {round_number}: {error_reason(error)}."

    # -- session

    def _start(self) -> None:
        """Submit the run, claim its ServerApp task, and map every client to the SuperNode that hosts it."""
        logging.getLogger("flwr").setLevel(logging.ERROR)
        try:
            self._open_session()
        except UserError:
            raise
        except Exception as exc:  # connection refused, TLS failure, ...: one sentence
            raise DeploymentError(f"Cannot use the SuperLink at {self.address}: {_reason(exc)}.") from exc
        self.site_map.ask(self._grid, self.config_json, self.wait_seconds, self.address)

    def _open_session(self) -> None:
        from flwr.cli.build import build_fab_from_files
        from flwr.common.serde import context_from_proto, fab_to_proto, run_from_proto
        from flwr.proto.control_pb2 import StartRunRequest
        from flwr.proto.runtime_pb2 import AcquireTaskRequest, PullTaskInputRequest
        from flwr.supercore.constant import TaskType
        from flwr.supercore.control.control_http_client import ControlHttpClient
        from flwr.supercore.fab import Fab
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supercore.task_identity import TaskIdentity
        from flwr.superlink.grid import HttpGrid

        with warnings.catch_warnings():  # Flower's builder uses a pattern class its pathspec deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            fab_bytes, _ = build_fab_from_files({"pyproject.toml": PYPROJECT})
        fab = Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})
        self._control = ControlHttpClient.from_server_address(
            self.address,
            self.insecure,
            self.certificates,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="fedaudit")],
        )
        run_id = self._control.StartRun(StartRunRequest(fab=fab_to_proto(fab))).run_id
        runtime = RuntimeHttpClient.from_server_address(
            self.address,
            self.insecure,
            self.certificates,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        )
        try:
            deadline = time.monotonic() + ACQUIRE_SECONDS
            while True:
                acquired = runtime.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.SERVER_APP]))
                if acquired.token and acquired.task.run_id == run_id:
                    break
                if time.monotonic() > deadline:
                    raise DeploymentError(
                        f"The SuperLink at {self.address} did not hand over the run's server task; start it with "
                        "--isolation process (fedaudit itself is the server) and no other server attached."
                    )
                time.sleep(POLL_SECONDS)
        finally:
            runtime.close()
        self._grid = HttpGrid(
            runtime_api_address=self.address,
            insecure=self.insecure,
            root_certificates=self.certificates,
            token=acquired.token,
        )
        task_input = self._grid._runtime_client.PullTaskInput(PullTaskInputRequest())
        TaskIdentity.task_id, TaskIdentity.run_id = task_input.task_id, task_input.run.run_id
        TaskIdentity.node_id = task_input.context.node_id
        self._grid.set_run(run_from_proto(task_input.run))
        self._context = context_from_proto(task_input.context)
        self._heartbeat = HeartbeatSender(self._beat)
        self._heartbeat.start()

    def _beat(self) -> bool:
        """Keep the server task alive (Flower's own helper would raise SIGINT in this process on a refusal)."""
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

        try:
            self._task_alive = bool(self._grid._runtime_client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success)
        except Exception:  # a transport error: the sender retries with back-off
            return False
        return True

    def close(self, *, completed: bool = True) -> None:
        """End the session: stop the heartbeat and tell the SuperLink whether the run completed."""
        if self._grid is None:
            return
        from flwr.common.constant import SubStatus
        from flwr.common.serde import context_to_proto
        from flwr.proto.runtime_pb2 import PushTaskOutputRequest
        from flwr.supercore.task_identity import TaskIdentity

        self._heartbeat.stop()
        try:
            self._grid._runtime_client.PushTaskOutput(
                PushTaskOutputRequest(
                    context=context_to_proto(self._context),
                    sub_status=SubStatus.COMPLETED if completed else SubStatus.FAILED,
                    details="" if completed else "the fedaudit server stopped the run",
                )
            )
        except Exception:  # the SuperLink may be gone; the run then expires there on its own
            pass
        finally:
            self._grid.close()
            self._control.close()
            self._grid = None
            TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = None


def _secure_failure(exc: SecureRoundError, client: int, round_number: int, engine: DeploymentEngine) -> UserError:
    """The one sentence for a round whose secure sum did not complete at ``client``'s site."""
    if exc.stage == "heartbeat":
        return DeploymentError(f"The SuperLink at {engine.address} ended this run (its heartbeat was refused).")
    if exc.error is not None:
        return DeploymentError(engine._failure(client, round_number, exc.error))
    if exc.reason is not None:
        return DeploymentError(
            f"Round {round_number}'s secure sum failed in SecAgg+'s {exc.stage} stage ({exc.reason.rstrip('.')}); "
            "check that every site runs the same fedaudit and Flower, and resume the run."
        )
    if exc.stage == "tensors":
        return DeploymentError(
            f"Client {client}'s site summed other tensors than the model's under SecAgg+; it runs another fedaudit: "
            "install the same version at every site."
        )
    return DeploymentError(
        f"Client {client}'s site did not answer round {round_number}'s {exc.stage} stage of the secure sum within "
        f"{engine.round_timeout:g} s; check its SuperNode and resume the run."
    )


def survey_sites(config: RunConfig) -> list[SiteReport]:
    """Ask every site of a federation whose sites keep their records what it holds (counts, positions of its
    members and held-out records, their hashes, shapes, classes, fingerprint; never a record), in client order."""
    engine = DeploymentEngine(config, num_clients=config.data.num_clients, membership=(), survey=True)
    with engine:
        engine._start()
    return [engine.site_map.reports[client] for client in range(config.data.num_clients)]


class SiteSignals:
    """Membership signals of a deployed run's records, computed at the sites that keep them (``fedaudit attack`` of
    a ``--dataset sites`` deployment): each site scores its own records at the positions asked for, on the model
    sent, and returns the signals and the records' hashes, which must be those membership.npz recorded."""

    def __init__(self, config: RunConfig, membership: Mapping[str, np.ndarray], fingerprint: str) -> None:
        """``config``: the run's, with this attack's connection settings; ``membership`` and ``fingerprint``: what
        the run recorded of its sites' records (membership.npz, the manifest's data fingerprint)."""
        self.membership = dict(membership)
        self.fingerprint = fingerprint
        self.engine = DeploymentEngine(config, num_clients=config.data.num_clients, membership=(), survey=True)
        self.federation = ""
        self.target = 0  # the round whose model is being scored (for messages about a site that fails)

    def __enter__(self) -> SiteSignals:
        try:
            self.engine._start()
            self._check_sites()
        except BaseException:
            self.engine.close(completed=False)  # __exit__ does not run when __enter__ raises
            raise
        return self

    def _check_sites(self) -> None:
        """Every site must still hold the records the run recorded (its hashes and fingerprint)."""
        reports = [self.engine.site_map.reports[k] for k in range(self.engine.num_clients)]
        changed = [
            r.client
            for r in reports
            if not np.array_equal(r.member_hashes, self.membership.get(f"member_hashes_{r.client}"))
            or not np.array_equal(r.heldout_hashes, self.membership.get(f"heldout_hashes_{r.client}"))
        ]
        if changed or sites_fingerprint([r.fingerprint for r in reports]) != self.fingerprint:
            which = f"client {changed[0]}'s site holds" if changed else "the sites hold"
            raise DeploymentError(
                f"{which[0].upper()}{which[1:]} other records than the run was trained on (the fingerprint or the "
                "records' hashes differ from what the run recorded); put them back to audit the run."
            )
        self.federation = json.dumps([report.compact() for report in reports])

    def __exit__(self, *exc: object) -> None:
        self.engine.close(completed=exc[0] is None)

    def __call__(
        self,
        params: TensorDict,
        positions: Mapping[int, np.ndarray],
        signals: Sequence[str],
        *,
        per_layer: bool,
        batch_size: int,
        round_number: int = 0,
    ) -> dict[int, dict[str, np.ndarray]]:
        """Per site, each signal of its records at ``positions[site]`` (in that order), on the model of round
        ``round_number``."""
        from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

        engine = self.engine
        self.target = round_number
        requests = {}
        for client, where in positions.items():
            task = {
                "config": engine.config_json,
                "client": client,
                "federation": self.federation,
                "signals": json.dumps(list(signals)),
                "per_layer": bool(per_layer),
                "batch_size": int(batch_size),
            }
            content = {
                "global": _to_record(params),
                "task": ConfigRecord(task),
                "positions": ArrayRecord({"positions": Array(np.ascontiguousarray(where, dtype=np.int64))}),
            }
            requests[client] = Message(
                RecordDict(content), message_type="query.signals", dst_node_id=engine.site_map.node_of[client]
            )
        replies = engine._exchange(requests, self.target, time.monotonic() + engine.round_timeout)
        found: dict[int, dict[str, np.ndarray]] = {}
        for client, where in positions.items():
            arrays = {name: a.numpy().copy() for name, a in replies[client].content["signals"].items()}
            expected = recorded_hashes(self.membership, client, np.asarray(where))
            if expected is None or not np.array_equal(arrays.pop("hashes"), expected):
                raise DeploymentError(
                    f"Client {client}'s site scored records whose hashes are not those membership.npz recorded; its "
                    "records changed since the run was trained."
                )
            found[client] = arrays
        return found


def _config_json(config: RunConfig) -> str:
    """The configuration the sites get: the run's, without the server's connection settings and data directory
    (each site names its own in its node config)."""
    import json
    from dataclasses import replace

    from fedaudit.config import FlowerConfig

    plain = replace(config, engine="local", flower=FlowerConfig(), data=replace(config.data, data_dir=None))
    return json.dumps(plain.to_dict(), sort_keys=True)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0].rstrip(".")

"""Canary clients for any Flower app: a strategy wrapper that audits the app's own Flower DP from one run.

``CanaryClients(strategy, canaries=m, seed=s, log=path)`` wraps a Flower strategy whose DP comes from Flower itself
(``DifferentialPrivacyServerSideFixedClipping``, ``DifferentialPrivacyClientSideFixedClipping`` with
``fixedclipping_mod``, or ``LocalDpMod`` on the clients). Following Andrew, Kairouz, Oh et al. (ICLR 2024,
"One-shot empirical privacy estimation for federated learning"):

- m canary clients are drawn from the seed: canary i has a random unit direction u_i in the flattened space of the
  model's floating-point parameters, and is included in the population with probability 1/2. The inclusion bits
  are secret: they go to the log for the audit, and the run reads nothing but which canaries exist.
- Included canary clients join the population the wrapped strategy samples from: it sees their node ids beside the
  real nodes' (a view of the grid), so Flower's own sampler picks them like any client.
- A sampled canary's reply is the round's model plus ``scale * C * u_i`` (ten times the clipping norm by default, so
  a correct clipping brings it to C u_i and a missing one lets ten times as much through). It passes through the
  client mods a real client's reply passes through (``client_mods``), then goes with the real replies into the
  wrapped strategy's ``aggregate_train``: the DP wrapper clips, weights and noises it exactly like theirs. Its
  weight is the largest weight a real reply carries in that round (the most exposed real client; with the equal
  weights Flower's DP noise assumes, the common weight), and its other metrics are the real replies' weighted mean,
  so the aggregated metrics do not change.
- After every round the log (``fedaudit.instruments.canary_log``) is rewritten atomically with the cosine of the round's
  aggregate update with every canary direction, included or not, and the cosine of the final model minus the
  initial one. ``fedaudit attack --flower-log LOG`` turns it into estimates and bounds of epsilon.

Canary clients are clients: they count in the population the accountant samples from, and the DP wrapper's
``num_sampled_clients`` must count the canary clients a round samples (the wrapper says so in one sentence when it
does not). Flower is imported here only: ``import fedaudit`` works without it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any

import flwr
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    Strategy,
)
from flwr.serverapp.strategy.dp_fixed_clipping import DifferentialPrivacyFixedClippingBase
from flwr.supercore import log as flower_log

from fedaudit.config import MAX_SEED
from fedaudit.errors import UserError
from fedaudit.instruments.canary_clients import CANARY_SCALE, CanarySpace, draw_inclusion
from fedaudit.instruments.canary_log import CanaryLog

DEFAULT_DELTA = 1e-5


class CanaryClientsError(UserError):
    """A canary-client set-up that cannot audit what it wraps (one sentence)."""


@dataclass(frozen=True)
class Mechanism:
    """The DP mechanism the canaries audit, read from the wrapped strategy and the client mods."""

    kind: str  # "central DP, server-side clipping", "central DP, client-side clipping" or "local DP (LocalDpMod)"
    noise_multiplier: float
    clipping_norm: float
    central: DifferentialPrivacyFixedClippingBase | None
    local: LocalDpMod | None


def canary_client_count(canaries: int, seed: int) -> int:
    """How many canary clients :class:`CanaryClients` with these arguments adds to the population: what the DP
    wrapper's ``num_sampled_clients`` must take into account before the strategy is built."""
    return int(draw_inclusion(canaries, seed).sum())


def strategy_chain(strategy: Strategy) -> list[Strategy]:
    """The strategy and every strategy it wraps (Flower's wrappers keep the wrapped one as ``.strategy``)."""
    chain = [strategy]
    while isinstance(getattr(chain[-1], "strategy", None), Strategy):
        chain.append(chain[-1].strategy)
    return chain


def find_mechanism(strategy: Strategy, client_mods: Sequence[Callable[..., Any]]) -> Mechanism:
    """The one Flower DP mechanism of an app, or a :class:`CanaryClientsError` saying why there is none to audit."""
    chain = strategy_chain(strategy)
    adaptive = (DifferentialPrivacyClientSideAdaptiveClipping, DifferentialPrivacyServerSideAdaptiveClipping)
    if any(isinstance(s, adaptive) for s in chain):
        raise CanaryClientsError(
            "Canary clients audit Flower's fixed-clipping DP only: adaptive clipping changes the clipping norm every "
            "round, which the log does not record."
        )
    central = [s for s in chain if isinstance(s, DifferentialPrivacyFixedClippingBase)]
    local = [mod for mod in client_mods if isinstance(mod, LocalDpMod)]
    if len(central) + len(local) > 1:
        raise CanaryClientsError("The app has more than one Flower DP mechanism; canary clients audit one at a time.")
    if central:
        dp = central[0]
        if isinstance(dp, DifferentialPrivacyClientSideFixedClipping):
            if not any(mod is fixedclipping_mod for mod in client_mods):
                raise CanaryClientsError(
                    "DifferentialPrivacyClientSideFixedClipping clips on the clients: pass "
                    "client_mods=[fixedclipping_mod] (the mods of your ClientApp) so that canary updates are clipped "
                    "like real ones."
                )
            kind = "central DP, client-side clipping"
        else:
            kind = "central DP, server-side clipping"
        return Mechanism(kind, float(dp.noise_multiplier), float(dp.clipping_norm), dp, None)
    if local:
        mod = local[0]
        if mod.epsilon <= 0 or mod.delta <= 0:
            raise CanaryClientsError("LocalDpMod needs epsilon > 0 and delta > 0 to add noise that can be audited.")
        deviation = mod.sensitivity * math.sqrt(2 * math.log(1.25 / mod.delta)) / mod.epsilon
        return Mechanism("local DP (LocalDpMod)", deviation / mod.clipping_norm, float(mod.clipping_norm), None, mod)
    raise CanaryClientsError(
        "The strategy has no Flower DP to audit: wrap DifferentialPrivacyServerSideFixedClipping or "
        "DifferentialPrivacyClientSideFixedClipping, or pass the ClientApp's LocalDpMod in client_mods."
    )


class _CanaryGrid(Grid):
    """The app's grid, with the included canary clients' node ids beside the real nodes': the wrapped strategy samples
    from both. Canary ids are negative, so they never meet a real node id, and nothing is ever sent to them."""

    def __init__(self, grid: Grid, canary_nodes: list[int]) -> None:
        self._grid = grid
        self._canary_nodes = canary_nodes

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return [*self._grid.get_node_ids(), *self._canary_nodes]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(self._real(messages))

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._grid.send_and_receive(self._real(messages), timeout=timeout)

    @staticmethod
    def _real(messages: Iterable[Message]) -> list[Message]:
        messages = list(messages)
        if any(m.metadata.dst_node_id < 0 for m in messages):
            raise RuntimeError("A strategy sent a message to a canary client directly; canary replies are made here.")
        return messages


@dataclass
class _Round:
    arrays: ArrayRecord
    canary_messages: list[Message]
    sampled: int
    population: int


class _CanarySpace(CanarySpace):
    """The canaries' space of a Flower app: the layout of the model's arrays (the floating-point ones, flattened in
    their order, are the space) on top of :class:`fedaudit.instruments.canary_clients.CanarySpace`."""

    def __init__(self, seed: int, canaries: int) -> None:
        super().__init__(seed, canaries)
        self.layout: list[tuple[str, tuple[int, ...], np.dtype, bool]] | None = None

    def begin_arrays(self, arrays: ArrayRecord) -> None:
        """On the first round: the layout of the model's arrays and the initial model."""
        if self.layout is not None:
            return
        layout = []
        for key, array in arrays.items():
            value = array.numpy()
            layout.append((key, tuple(value.shape), value.dtype, bool(np.issubdtype(value.dtype, np.floating))))
        if not any(floating for *_, floating in layout):
            raise CanaryClientsError("The model has no floating-point array for canary directions to live in.")
        self.layout = layout
        self.begin(self.flatten(arrays))

    def flatten(self, arrays: ArrayRecord) -> np.ndarray:
        """The floating-point arrays, in their order, as one float64 vector (the space of the canary directions)."""
        parts = []
        for key, shape, _, floating in self.layout or []:
            if key not in arrays or tuple(arrays[key].shape) != shape:
                raise CanaryClientsError(f"The model's array {key!r} changed its shape or went missing during the run.")
            if floating:
                parts.append(arrays[key].numpy().astype(np.float64).ravel())
        return np.concatenate(parts)

    def record_round(self, pending: _Round, arrays: ArrayRecord | None, *, equal: bool) -> None:
        """The round's row: the update released (``arrays``, None when the strategy released no model) against the
        model the round began from."""
        after = None if arrays is None else self.flatten(arrays)
        self.record(
            self.flatten(pending.arrays), after, sampled=pending.sampled, population=pending.population, equal=equal
        )


class CanaryClients(Strategy):
    """Adds canary clients (Andrew et al., ICLR 2024) to any Flower strategy with Flower's own DP, and logs the
    cosines the audit needs (see the module's docstring).

    Args:
        strategy: the app's strategy, Flower's DP wrapper included (for local DP, any strategy).
        canaries: m, the canary clients drawn (each included with probability 1/2).
        seed: draws the directions and the inclusion bits, in [0, 2**32).
        log: the log file (.npz), rewritten atomically after every round.
        client_mods: the ClientApp's mods that act on a reply (``fixedclipping_mod``, ``LocalDpMod``), applied to the
            canary replies in the same order.
        delta: the delta of the audit and of the accountant. [default: the target delta of the DP wrapper's Flower
            accountant, else 1e-5]
        scale: a canary's update norm before clipping, in units of the clipping norm (at least 1).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        canaries: int,
        seed: int,
        log: str | Path,
        client_mods: Sequence[Callable[..., Any]] = (),
        delta: float | None = None,
        scale: float = CANARY_SCALE,
    ) -> None:
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise CanaryClientsError(f"CanaryClients wraps a Flower strategy, not a {type(strategy).__name__}.")
        if isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 4:
            raise CanaryClientsError(f"canaries must be an integer of at least 4, got {canaries!r}.")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise CanaryClientsError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r}.")
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale >= 1):
            raise CanaryClientsError(f"scale must be a finite number of at least 1, got {scale!r}.")
        self.strategy = strategy
        self.client_mods = tuple(client_mods)
        self.mechanism = find_mechanism(strategy, self.client_mods)
        accountant = getattr(self.mechanism.central, "accountant", None)
        if delta is None:
            delta = accountant.config.target_delta if accountant is not None else DEFAULT_DELTA
        if not (isinstance(delta, (int, float)) and 0 < delta < 1):
            raise CanaryClientsError(f"delta must be in (0, 1), got {delta!r}.")
        self.delta = float(delta)
        self.seed = seed
        self.scale = float(scale)
        self.log_path = Path(log)
        self.included = draw_inclusion(canaries, seed)
        # node id -> canary index; negative ids (no real node has one), distinct for wrappers of distinct seeds
        self._node_of = {-(1 + (seed << 32) + int(i)): int(i) for i in np.flatnonzero(self.included)}
        chain = strategy_chain(strategy)
        self._weight_key: str | None = getattr(chain[-1], "weighted_by_key", None)
        self._min_nodes = int(getattr(chain[-1], "min_available_nodes", 0) or 0)
        self._description = "(".join(type(s).__name__ for s in chain) + ")" * (len(chain) - 1)
        self._space = _CanarySpace(seed, len(self.included))
        self._pending: dict[int, _Round] = {}

    @property
    def canaries(self) -> int:
        return int(len(self.included))

    @property
    def canary_clients(self) -> int:
        """How many canary clients joined the population (the included ones)."""
        return len(self._node_of)

    def __repr__(self) -> str:
        return f"CanaryClients({self.canaries} canaries, seed {self.seed}) around {self._description}"

    def summary(self) -> None:
        """Log what is audited, then the wrapped strategy's summary."""
        mechanism = self.mechanism
        flower_log(INFO, "\t├──> Canary clients (fedaudit): %s drawn, log %s", self.canaries, self.log_path)
        flower_log(
            INFO,
            "\t│\t└── auditing %s, sigma %s, C %s",
            mechanism.kind,
            mechanism.noise_multiplier,
            mechanism.clipping_norm,
        )
        self.strategy.summary()

    # --- training -------------------------------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's messages to the real nodes it sampled; those to canary clients are kept here."""
        self._space.begin_arrays(arrays)
        nodes = self._wait_for_nodes(grid)
        if not self._node_of.keys().isdisjoint(grid.get_node_ids()):
            raise CanaryClientsError("Two CanaryClients around one strategy need different seeds.")
        messages = list(self.strategy.configure_train(server_round, arrays, config, _CanaryGrid(grid, self._nodes())))
        canary = [m for m in messages if m.metadata.dst_node_id in self._node_of]
        real = [m for m in messages if m.metadata.dst_node_id not in self._node_of]
        inner = [s for s in strategy_chain(self.strategy) if isinstance(s, CanaryClients)]
        sampled = inner[0]._pending[server_round].sampled if inner else len(messages)  # inner ones took theirs
        dp = self.mechanism.central
        if dp is not None and sampled and sampled != dp.num_sampled_clients:
            raise CanaryClientsError(
                f"Round {server_round} sampled {sampled} clients out of {nodes} nodes and "
                f"{sum(s.canary_clients for s in [self, *inner])} canary clients, but {type(dp).__name__} has "
                f"num_sampled_clients={dp.num_sampled_clients}, which its noise assumes: set it to {sampled}."
            )
        added = sum(s.canary_clients for s in [self, *inner])
        self._pending[server_round] = _Round(arrays, canary, sampled, nodes + added)
        return real

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The wrapped strategy's aggregate of the real replies and the canary clients' replies; logs the round."""
        pending = self._pending.pop(server_round)
        replies = list(replies)
        valid = [r for r in replies if not r.has_error()]
        array_key = next(iter(valid[0].content.array_records), None) if valid else None
        metric_key, canary_metrics = self._canary_metrics(valid)
        sent: dict[int, dict[str, np.ndarray]] = {}  # each distinct ArrayRecord sent, read once
        canary = [self._canary_reply(m, array_key, (metric_key, canary_metrics), sent) for m in pending.canary_messages]
        weights = [w for w in (self._weight(r) for r in [*valid, *canary]) if w is not None]
        arrays, metrics = self.strategy.aggregate_train(server_round, [*replies, *canary])
        self._space.record_round(pending, arrays, equal=len(set(weights)) <= 1)
        self.to_log().write(self.log_path)
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation is the wrapped strategy's, on real nodes only."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    # --- canary clients -------------------------------------------------------------------------------------------

    def _nodes(self) -> list[int]:
        return list(self._node_of)

    def _wait_for_nodes(self, grid: Grid) -> int:
        """The number of real nodes, once at least as many are connected as the wrapped strategy waits for (canary
        clients must not make it start early)."""
        while len(nodes := list(grid.get_node_ids())) < self._min_nodes:
            time.sleep(1)
        return len(nodes)

    def _canary_reply(
        self,
        message: Message,
        array_key: str | None,
        metrics: tuple[str, MetricRecord],
        sent: dict[int, dict[str, np.ndarray]],
    ) -> Message:
        """Canary i's reply to ``message``: the sent model plus scale * C * u_i under the real replies' record names
        (``array_key``: None when no real client replied, then the sent one's), through the client mods."""
        index = self._node_of[message.metadata.dst_node_id]
        records = list(message.content.array_records.items())
        if len(records) != 1:
            raise CanaryClientsError("Canary clients need the strategy to send exactly one ArrayRecord per message.")
        sent_key, record = records[0]
        if id(record) not in sent:
            sent[id(record)] = {key: array.numpy() for key, array in record.items()}
        update = self.scale * self.mechanism.clipping_norm * self._space.directions(np.array([index]))[0]
        out, start = {}, 0
        for key, shape, dtype, floating in self._space.layout or []:
            value = sent[id(record)][key]
            if floating:
                size = int(np.prod(shape))
                value = (value.astype(np.float64) + update[start : start + size].reshape(shape)).astype(dtype)
                start += size
            out[key] = Array(np.ascontiguousarray(value))
        content = RecordDict({array_key or sent_key: ArrayRecord(out), metrics[0]: MetricRecord(dict(metrics[1]))})
        reply = Message(content, reply_to=message)
        return self._through_mods(message, reply)

    def _canary_metrics(self, valid: list[Message]) -> tuple[str, MetricRecord]:
        """The largest real weight of the round and, for every other metric, the real replies' weighted mean."""
        key = self._weight_key
        if not valid or len(valid[0].content.metric_records) != 1:
            return "metrics", MetricRecord({key: 1.0} if key else {})
        name, first = next(iter(valid[0].content.metric_records.items()))
        records = [r.content.metric_records.get(name) for r in valid]
        if any(r is None or set(r) != set(first) for r in records):
            return name, MetricRecord(dict(first))  # inconsistent replies: the strategy reports them as it would
        weights = np.array([float(r[key]) if key in first else 1.0 for r in records])
        share = weights / weights.sum() if weights.sum() > 0 else np.full(len(records), 1.0 / len(records))
        values: dict[str, Any] = {}
        for metric, value in first.items():
            if metric == key:
                values[metric] = max(r[key] for r in records)
            elif isinstance(value, list):
                values[metric] = [
                    float(v) for v in np.sum([s * np.asarray(r[metric]) for s, r in zip(share, records)], 0)
                ]
            else:
                values[metric] = float(sum(s * float(r[metric]) for s, r in zip(share, records)))
        return name, MetricRecord(values)

    def _through_mods(self, message: Message, reply: Message) -> Message:
        """``reply`` after the client mods, as Flower's ClientApp applies them (the first mod is the outermost)."""

        def link(mod: Callable[..., Message], after: Callable[[Message, Context], Message]) -> Callable[..., Message]:
            return lambda msg, ctxt: mod(msg, ctxt, after)

        call: Callable[[Message, Context], Message] = lambda msg, ctxt: reply  # noqa: E731
        for mod in reversed(self.client_mods):
            call = link(mod, call)
        context = Context(run_id=message.metadata.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={})
        out = call(message, context)
        if out.has_error():
            raise CanaryClientsError(f"A client mod refused a canary client's reply: {out.error.reason}")
        return out

    def _weight(self, reply: Message) -> float | None:
        records = list(reply.content.metric_records.values()) if not reply.has_error() else []
        if self._weight_key is None or len(records) != 1 or self._weight_key not in records[0]:
            return None
        return float(records[0][self._weight_key])

    def to_log(self) -> CanaryLog:
        """The log of the rounds so far."""
        space = self._space
        if not space.rows or space.initial is None or space.latest is None:
            raise CanaryClientsError("No round has been aggregated yet, so there is no canary log.")
        epsilon, delta, report = self._flower_report()
        return space.log(
            seed=self.seed,
            included=self.included,
            scale=self.scale,
            clipping_norm=self.mechanism.clipping_norm,
            noise_multiplier=self.mechanism.noise_multiplier,
            mechanism=self.mechanism.kind,
            strategy=self._description,
            delta=self.delta,
            flower_epsilon=epsilon,
            flower_delta=delta,
            flower_report=report,
            flower_version=flwr.__version__,
        )

    def _flower_report(self) -> tuple[float, float, str]:
        """What Flower itself reports about privacy: its epsilon and delta (NaN when none), and in words."""
        dp, mod = self.mechanism.central, self.mechanism.local
        if mod is not None:
            return (
                float(mod.epsilon),
                float(mod.delta),
                f"Flower reports LocalDpMod's epsilon {mod.epsilon:g} at delta {mod.delta:g} for one client's update "
                "in one round, as configured; it composes nothing over rounds.",
            )
        assert dp is not None
        if dp.accountant is None:
            return (
                math.nan,
                math.nan,
                f"Flower reports no epsilon: {type(dp).__name__} without an accountant logs only the noise's "
                "standard deviation (sigma C / n) each round.",
            )
        spent = dp.privacy_spent()
        return (
            float(spent.epsilon),
            float(spent.delta),
            f"Flower's accountant ({spent.accounting_method}) reports epsilon {spent.epsilon:.4g} at delta "
            f"{spent.delta:g} after {spent.num_releases} releases, charging every round in full: its fixed-clipping "
            "wrappers allow no amplification by client sampling.",
        )

"""The client/server seam shared by every algorithm and engine.

A client is a function of (global parameters, its data, round context)
returning a :class:`ClientMessage`; a server is a function of (global
parameters, messages) returning new global parameters. Messages hold plain
tensors plus metadata, so the same algorithm runs in-process or under Flower,
and an audit can look at exactly what crossed the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedaudit.config import ConfigError, RunConfig
from fedaudit.instruments.queries import QueryAudit, QueryLog
from fedaudit.privacy.accounting import SGMEvent
from fedaudit.privacy.primitive import poisson_sample
from fedaudit.privacy.randomness import ClientKeys, QueryDraws, Source
from fedaudit.registry import ALGORITHMS

TensorDict = dict[str, torch.Tensor]
# Records per forward pass when the model is evaluated. The activations of the width-128 ConvNet on Fashion-MNIST
# peak at about 0.1 GB per 64 records, and a thousand-client run peaked at the evaluation (1.4 GB at 1,024 a batch);
# on one CPU thread 64 a batch was also the fastest (4.2 s per 2,048 records against 5.2-5.9 s at 256).
EVAL_BATCH = 64


@dataclass(frozen=True)
class ClientData:
    """One client's training records (already on the training device), and the canaries it holds for an audit.

    ``num_examples`` counts the client's own records only: its DP sampling rate B / N_k and its aggregation weight
    do not depend on which canaries it holds.
    """

    client_id: int
    x: torch.Tensor
    y: torch.Tensor
    # per-example gradients of the gradient canaries this client holds (10 C u_i), name -> [canaries, *shape]
    canary_grads: TensorDict | None = None
    # the input canaries this client holds: records (with their replaced labels) trained on like its own
    canary_x: torch.Tensor | None = None
    canary_y: torch.Tensor | None = None
    # a canary run's query audit, and the log of the round under way (see run_client)
    audit: QueryAudit | None = None
    recorder: QueryLog | None = None
    # the sources of this round's DP queries, from the client's secret (see run_client)
    draws: QueryDraws | None = None

    @property
    def num_examples(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_canaries(self) -> int:
        if self.canary_grads:
            return int(next(iter(self.canary_grads.values())).shape[0])
        return 0 if self.canary_y is None else int(self.canary_y.shape[0])

    def next_query(self) -> Source:
        """The source of the client's next DP query: a generator (or secure stream) of its own, derived from the
        client's secret and the query's place in the round (:class:`fedaudit.privacy.randomness.QueryDraws`)."""
        if self.draws is None:
            raise RuntimeError("A DP query needs the client's query draws: run the client through run_client.")
        return self.draws.next()

    def dp_batch(self, sample_rate: float) -> DPBatch:
        """One Poisson batch of a new DP query: (inputs, labels, per-example gradients of sampled gradient canaries,
        the query's source, which its noise must come from too).

        The client's records are sampled with rate ``sample_rate`` from the query's own source, then its canaries
        with the same rate from the same source (drawn only when it holds any); sampled input canaries join the
        batch as records.
        """
        source = self.next_query()
        idx = poisson_sample(self.num_examples, sample_rate, generator=source)
        x, y, extra = self.x[idx.to(self.x.device)], self.y[idx.to(self.y.device)], None
        sampled = None
        if self.num_canaries:
            sampled = poisson_sample(self.num_canaries, sample_rate, generator=source)
            if self.canary_grads:
                extra = {name: g[sampled.to(g.device)] for name, g in self.canary_grads.items()}
            else:
                x = torch.cat([x, self.canary_x[sampled.to(self.canary_x.device)]])
                y = torch.cat([y, self.canary_y[sampled.to(self.canary_y.device)]])
        if self.recorder is not None and self.audit is not None:
            drawn = self.audit.held[sampled.cpu().numpy()] if sampled is not None else self.audit.held[:0]
            self.recorder.batch(idx, drawn, sample_rate)
        return DPBatch(x, y, extra, source)


class DPBatch(NamedTuple):
    """A DP query's Poisson batch and the source it was drawn from (the query's noise is drawn from it next)."""

    x: torch.Tensor
    y: torch.Tensor
    extra: TensorDict | None  # per-example gradients of the gradient canaries drawn
    source: Source


@dataclass(frozen=True)
class RoundContext:
    """What every participant knows about the current round.

    ``server_state`` is what the server broadcasts with the global model besides the weights (SCAFFOLD's server
    control variate). ``server_kept`` is what the server keeps for itself between rounds (FedGM's received sets):
    it is for :meth:`Algorithm.server_update` only, and no engine sends it to a client. Both are empty for
    algorithms that keep no server state.
    """

    round: int  # 0-based index of the round being run
    rounds: int
    config: RunConfig
    device: torch.device
    server_state: TensorDict = field(default_factory=dict)
    server_kept: TensorDict = field(default_factory=dict)
    run_id: str = ""  # the run's public identifier: a site's secret derives this run's keys with it
    population: int = 0  # client-level DP: the clients the server samples from, canary clients included (0: K)
    participants: int = 0  # client-level DP: the clients the server sampled this round, canary clients included

    def cosine_lr(self, base_lr: float) -> float:
        """``base_lr`` with cosine decay over rounds (round 0 uses the full rate)."""
        if self.config.federated.lr_schedule == "constant":
            return base_lr
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * self.round / self.rounds))


SECURE_SUM = -1  # the client id of a round's secure sum: the payloads the server received only added up


@dataclass
class ClientMessage:
    """What a client sends to the server after a round.

    ``payload`` holds the tensors that cross the wire (a model delta, or a
    synthetic set); ``privacy_events`` are the DP queries the client made on
    its records this round (the accountant also applies its own worst case).
    ``state`` is what the client needs in its next round (e.g. FedLAP's synthetic set for ``--init previous``). The
    engines keep it on the server's side between rounds (the Flower engines carry it there and back) and in the run
    directory for ``--resume``, so it may hold only what the server may see: what was sent, post-processing of it,
    or what the server dealt (FedGM, whose unsent set must not, remakes it every round instead).
    """

    client_id: int
    num_examples: int
    payload: TensorDict
    metrics: dict[str, float] = field(default_factory=dict)
    privacy_events: list[SGMEvent] = field(default_factory=list)
    state: TensorDict = field(default_factory=dict)  # for the client's next round, held on the server's side
    audit: TensorDict = field(default_factory=dict)  # a canary run's query log of the round: the auditor's tap

    @property
    def nbytes(self) -> int:
        """Bytes of tensor payload sent upstream."""
        return sum(t.numel() * t.element_size() for t in self.payload.values())


@dataclass(frozen=True)
class ServerResult:
    """New global parameters, the server state broadcast with them next round and the state the server keeps to
    itself (see :class:`RoundContext`), and what the server measured while computing them.

    ``dealt`` is what the server sends to single clients to keep, by client id (Fedssyn's share of the shuffled
    synthetic records): it joins that client's kept state (the ``state`` argument of its next
    :meth:`Algorithm.client_update`), so it reaches the client in every later round it takes part in.
    """

    params: TensorDict
    metrics: dict[str, Any] = field(default_factory=dict)
    state: TensorDict = field(default_factory=dict)
    kept: TensorDict = field(default_factory=dict)
    dealt: dict[int, TensorDict] = field(default_factory=dict)


class Algorithm(Protocol):
    """A federated algorithm: a client update, a server update, and its worst-case DP query count.

    Two optional members change the round loop for algorithms that need it (:func:`setup_rounds` and
    :func:`privacy_plan` read them): ``setup_rounds``, the number of leading rounds in which every client takes part
    whatever ``--client-fraction`` says (Fedssyn's generation round), and ``privacy_plan(config, num_examples,
    round)``, the SGM events a client is charged for in a round it takes part in when they are not the usual
    ``queries_per_round`` steps at rate B / N_k. A third, ``keeps_client_states`` (true for SCAFFOLD), makes a
    client-level run write its clients' states every round, so that which rounds changed one does not tell the
    round's sample.
    """

    name: str

    def client_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        state: TensorDict | None = None,
    ) -> ClientMessage:
        """Run one round on a client; ``model`` is a scratch module, ``state`` what it kept from its last round."""

    def server_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        messages: list[ClientMessage],
        ctx: RoundContext,
        generator: torch.Generator,
    ) -> ServerResult:
        """Combine the selected clients' messages into the next global parameters."""

    def queries_per_round(self, config: RunConfig, num_examples: int) -> int:
        """Worst-case number of DP queries a client with ``num_examples`` records makes per round."""


def run_client(
    algorithm: Algorithm,
    model: nn.Module,
    global_params: TensorDict,
    data: ClientData,
    ctx: RoundContext,
    keys: ClientKeys,
    state: TensorDict | None = None,
) -> ClientMessage:
    """One client update, as every engine runs it, with the client's draws from ``keys``: its round generator for
    everything but its DP queries, and a fresh source for each DP query (:meth:`ClientData.dp_batch`). In a canary
    run the client's DP queries are logged (its :class:`QueryLog` rides on the data the algorithm sees) and the log
    joins the message."""
    device = torch.device(ctx.device)
    generator = keys.round_generator(ctx.round, device)
    data = replace(data, draws=QueryDraws(keys, ctx.round, device))
    if data.audit is None:
        return algorithm.client_update(model, global_params, data, ctx, generator, state=state)
    log = data.audit.log(data.client_id, ctx.round, next(iter(global_params.values())).device)
    message = algorithm.client_update(model, global_params, replace(data, recorder=log), ctx, generator, state=state)
    message.audit = log.arrays()
    return message


def aggregation_weights(messages: list[ClientMessage], weighting: str) -> list[float]:
    """N_k / sum N_k over the received messages, or uniform weights."""
    if weighting == "uniform":
        return [1.0 / len(messages)] * len(messages)
    total = sum(m.num_examples for m in messages)
    return [m.num_examples / total for m in messages]


def clone_params(params: TensorDict) -> TensorDict:
    """Independent copies of a parameter dict."""
    return {name: p.detach().clone() for name, p in params.items()}


def load_params(model: nn.Module, params: TensorDict) -> None:
    """Copy ``params`` into the model's parameters in place (no autograd history)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def flat_distance(a: TensorDict, b: TensorDict) -> float:
    """||a - b||_2 over all parameters flattened into one vector (the trust-region distance).

    One read-back from the device per call (the per-tensor sums are added in float64 there).
    """
    squares = torch.stack([(a[name].detach() - b[name].detach()).pow(2).sum() for name in a])
    return math.sqrt(float(squares.to(torch.float64).sum()))


def setup_rounds(algorithm: Algorithm) -> int:
    """The leading rounds in which every client takes part (0 for most algorithms)."""
    return int(getattr(algorithm, "setup_rounds", 0))


def privacy_plan(algorithm: Algorithm, config: RunConfig, num_examples: int, round_index: int) -> list[SGMEvent] | None:
    """The SGM events a client with ``num_examples`` records is charged for at worst in a round ``round_index`` it
    takes part in, when the algorithm plans them itself; None for the usual plan (``queries_per_round`` steps at
    rate B / N_k)."""
    plan = getattr(algorithm, "privacy_plan", None)
    return None if plan is None else plan(config, num_examples, round_index)


def num_classes(model: nn.Module, params: TensorDict, x: torch.Tensor) -> int:
    """The dataset's number of classes: the width of the model's output on one record."""
    with torch.no_grad():
        return int(functional_call(model, {name: p.detach() for name, p in params.items()}, (x[:1],)).shape[1])


def evaluation_counts(
    model: nn.Module, params: TensorDict, x: torch.Tensor, y: torch.Tensor, batch_size: int = EVAL_BATCH
) -> tuple[int, float, int]:
    """Records classified right, the summed cross-entropy and the number of records: what a site reports of the
    model's quality on its own test records."""
    load_params(model, params)
    model.eval()
    losses, rights = [], []
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            logits = model(xb)
            losses.append(F.cross_entropy(logits, yb, reduction="sum"))
            rights.append((logits.argmax(dim=1) == yb).sum())
    if not losses:
        return 0, 0.0, 0
    # read back once (a read per batch would make a GPU wait for every batch), summed in batch order in float64
    total_loss = float(torch.stack(losses).double().cpu().sum())
    return int(torch.stack(rights).sum()), total_loss, len(y)


class SGD:
    """SGD with momentum (no dampening, weight decay or Nesterov), for every algorithm's steps.

    The arithmetic of torch.optim.SGD's single-tensor path, which it takes on CPU: the same parameters after every
    step, bit for bit. torch.optim's step imports TorchDynamo, the compiler, on its first call: 1.7 s of a 2-core
    machine at the start of every process that trains (a Flower ClientApp is a new process every round), for a graph
    break that fedaudit, which never compiles, does not need.
    """

    def __init__(self, params: Any, lr: float, momentum: float = 0.0) -> None:
        self.params: list[torch.Tensor] = list(params)
        self.lr, self.momentum = float(lr), float(momentum)
        self._buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: set them to None, or zero them in place (detached from any graph)."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """p <- p - lr * b, with b <- momentum * b + grad (b = grad at a parameter's first step).

        Off the CPU the updates of all parameters go in one launch each (torch.optim's foreach path there): a DP
        step's few milliseconds on a GPU are spent launching kernels, and a ConvNet has 14 parameter tensors."""
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if live and self.params[live[0]].device.type != "cpu":
            self._step_together(live)
            return
        for i in live:
            p = self.params[i]
            grad = p.grad
            if self.momentum != 0:
                buffer = self._buffers[i]
                if buffer is None:
                    buffer = self._buffers[i] = grad.detach().clone()
                else:
                    buffer.mul_(self.momentum).add_(grad)
                grad = buffer
            p.add_(grad, alpha=-self.lr)

    @torch.no_grad()
    def _step_together(self, live: list[int]) -> None:
        """The step of :meth:`step` as foreach operations over the parameters that have a gradient."""
        params = [self.params[i] for i in live]
        grads = [p.grad for p in params]
        if self.momentum != 0:
            started = [i for i in live if self._buffers[i] is not None]
            if started:
                buffers = [self._buffers[i] for i in started]
                torch._foreach_mul_(buffers, self.momentum)
                torch._foreach_add_(buffers, [self.params[i].grad for i in started])
            for i in live:
                if self._buffers[i] is None:
                    self._buffers[i] = self.params[i].grad.detach().clone()
            grads = [self._buffers[i] for i in live]
        torch._foreach_add_(params, grads, alpha=-self.lr)


def get_algorithm(config: RunConfig) -> Algorithm:
    """The algorithm object for ``config.federated.algorithm``, built from its registry entry."""
    entry = ALGORITHMS.get(config.federated.algorithm)
    if entry is None:
        raise ConfigError(f"Unknown algorithm '{config.federated.algorithm}'; choose one of: {', '.join(ALGORITHMS)}.")
    return entry.build(config)

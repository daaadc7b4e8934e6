"""The query log of a canary run: what every DP query of a client released, seen where the mechanism releases it.

In a canary run each client's one DP primitive is handed a :class:`QueryLog` (its recorder). For every query it
answers the log keeps:

- the query's metadata: step, records drawn, canaries drawn, sigma, C, the expected batch size B and the sampling
  rate q the client used;
- for each canary that belongs to the client (included or not), its projection on what the released noisy sum
  holds beyond the client's own records, o_i = <S + N - S_own, u_i> / C, where S_own is the clean clipped sum of
  the records the query drew (the auditor knows every record and their batch, not which canaries were drawn: the
  Poisson draws are independent, so this knowledge leaves each canary's guarantee as it was) and u_i is a gradient
  canary's direction, or an input canary's normalised gradient at the query's point (computed there, one per
  query). Without S_own, the records' gradients projected on the canaries' directions would drown the canaries'
  signal wherever the model has many parameters. The projections are reduced at once to two per-canary
  statistics of the round: the
  sum of o_i over the round's queries and the sum of the per-query log-likelihood ratio of the Poisson-subsampled
  Gaussian, log(1 - q + q exp((2 o_i - 1) / (2 sigma^2))) (the per-query projections themselves would take hundreds
  of MB on Fashion-MNIST: queries x canaries);
- a few whole queries, chosen from the run's seed on a stream of their own (pairs of consecutive queries, so that
  noise reused across steps can be seen): the point the gradients were taken at, the batch as the gradients saw it,
  the positions of the client's records it drew, the gradient canaries drawn, the released sum, and whether it was
  drawn on a GPU. ``fedaudit
  verify`` recomputes their clean clipped sums with an independent loop, and tests their noise and sample against
  every public stream.

A client whose queries are not all gradients of the model (Fedssyn's generation round: a class-count query, then
the generator's DP-SGD steps) switches the log to another :class:`Space` first: the generator's steps are projected
on canary directions in the generator's parameters (input canaries: on their normalised gradients of the generator's
loss), and a query whose space is None is recorded with its metadata only (``projected`` 0): the class counts live
in ten numbers that every canary of a class shares, so no canary's projection there could tell it apart. Whole
queries are kept in the model's own space only, where ``fedaudit verify`` can recompute them.

The log never touches the training's generator or tensors, so a run records the same training with or without it.
The round's arrays travel with the client's message (:attr:`ClientMessage.audit`) and the training core writes
them to ``queries/round-NNNN.safetensors``. docs/audit.md (the query view) says how they are read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedaudit.instruments.canaries import canary_rows
from fedaudit.privacy.primitive import LossFn, Query, per_sample_gradients
from fedaudit.privacy.randomness import cuda_draw_threads
from fedaudit.seeding import Stream, make_generator

TensorDict = dict[str, torch.Tensor]

_BUFFER = 64  # released sums projected together (one matrix product instead of many)
_DIRECTIONS_CHUNK = 1024  # canaries whose directions are held at once
_NO_BATCH = "A DP query was recorded without its batch: draw it with ClientData.dp_batch."


@dataclass(frozen=True)
class Space:
    """Where the log projects the queries that follow :meth:`QueryLog.enter`: the parameters the canaries'
    directions span (by name; a subset of the queried model's), and for input canaries their rows as that model
    takes them, their labels and the loss its queries differentiate."""

    shapes: dict[str, torch.Size]
    inputs: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    loss_fn: LossFn = F.cross_entropy


@dataclass(frozen=True)
class QueryAudit:
    """What a client needs to keep its query log: its canaries and how often to keep a whole query."""

    seed: int  # the run's seed: canary directions and the choice of whole queries derive from it
    canaries: np.ndarray  # int64 ids of every canary of this client, included or not
    held: np.ndarray  # int64 ids of the canaries in its data, in the order ClientData holds them
    shapes: dict[str, torch.Size]  # the model's trainable parameters, in order
    keep_pairs: float  # pairs of whole queries a round of this client keeps on average
    planned_queries: int  # queries the client plans per round (where a kept pair may start)
    inputs: torch.Tensor | None = None  # input canaries: the records of ``canaries``, in that order
    labels: torch.Tensor | None = None  # input canaries: the labels they are trained with
    layout: str = "model"  # gradient canaries: where their directions lie (fedaudit.instruments.canaries.LAYOUTS)

    def log(self, client: int, round_index: int, device: torch.device) -> QueryLog:
        """A fresh log for one round of ``client``."""
        return QueryLog(self, client, round_index, device)

    @property
    def space(self) -> Space:
        """The model's own space: where a log starts and where whole queries are kept."""
        return Space(self.shapes, self.inputs, self.labels)


class QueryLog:
    """The recorder of one client's round (see the module docstring); :meth:`arrays` is what it gathered."""

    def __init__(self, audit: QueryAudit, client: int, round_index: int, device: torch.device) -> None:
        self.audit, self.client, self.round, self.device = audit, client, round_index, device
        chooser = make_generator(audit.seed, Stream.QUERY_AUDIT, round_index, client)
        pairs = audit.keep_pairs
        keep = bool(torch.rand(1, generator=chooser).item() < min(pairs, 1.0))
        span = max(audit.planned_queries - 1, 1)
        self.kept_steps = {int(torch.randint(span, (1,), generator=chooser).item())} if keep else set()
        if pairs > 1:  # more than a pair a round: floor(pairs - 1) more, and one with the remainder's probability
            whole, fraction = divmod(pairs - 1, 1.0)
            more = int(whole) + int(torch.rand(1, generator=chooser).item() < fraction)
            self.kept_steps |= {int(step) for step in torch.randperm(span, generator=chooser)[:more].tolist()}
        self.kept_steps |= {step + 1 for step in self.kept_steps}
        self.meta: dict[str, list[float]] = {
            key: []
            for key in ("records", "canaries", "noise_multiplier", "max_grad_norm", "batch", "rate", "projected")
        }
        self._space: Space | None = audit.space
        count = len(audit.canaries)
        self.sum = torch.zeros(count, dtype=torch.float64, device=device)
        self.llr = torch.zeros(count, dtype=torch.float64, device=device)
        self.kept: list[TensorDict] = []
        self._pending: tuple[torch.Tensor, np.ndarray, float] | None = None
        self._buffer: list[tuple[torch.Tensor, float, float, float]] = []
        self._directions: list[torch.Tensor] | None = None

    @property
    def steps(self) -> int:
        return len(self.meta["rate"])

    def enter(self, space: Space | None) -> None:
        """Project the queries that follow in ``space`` (None: record their metadata only)."""
        self._flush()
        self._space, self._directions = space, None

    def batch(self, index: torch.Tensor, canaries: np.ndarray, rate: float) -> None:
        """What the next query's Poisson batch drew: the positions of the client's records drawn (in its data), the
        ids of the canaries drawn, the rate."""
        self._pending = (index, canaries, rate)

    def own_rows(self) -> int:
        """Rows of the next query's inputs that are the client's own records: the batch puts them first."""
        if self._pending is None:
            raise RuntimeError(_NO_BATCH)
        return int(self._pending[0].numel())

    def record(self, query: Query) -> None:
        """Take note of one answered query (the primitive calls this)."""
        if self._pending is None:
            raise RuntimeError(_NO_BATCH)
        index, canaries, rate = self._pending
        records = int(index.numel())
        self._pending = None
        step, space = self.steps, self._space
        projected = space is not None and len(self.audit.canaries) > 0
        for key, value in (
            ("records", records),
            ("canaries", len(canaries)),
            ("noise_multiplier", query.noise_multiplier),
            ("max_grad_norm", query.max_grad_norm),
            ("batch", query.expected_batch_size),
            ("rate", rate),
            ("projected", projected),
        ):
            self.meta[key].append(float(value))
        if space is None:
            return
        flat = torch.cat([query.released[name].detach().reshape(-1) for name in space.shapes])
        if step in self.kept_steps and space.shapes == self.audit.shapes:
            self.kept.append(
                {
                    "step": torch.tensor([step]),
                    "params": torch.cat([query.params[name].detach().reshape(-1) for name in self.audit.shapes]),
                    "released": flat.clone(),
                    "x": query.x.detach().clone(),
                    "y": query.y.detach().clone(),
                    "canaries": torch.from_numpy(np.asarray(canaries, dtype=np.int64)),
                    "index": index.detach().to("cpu", torch.int64).clone(),
                    "cuda": torch.tensor([int(self.device.type == "cuda")]),  # where its noise was drawn
                    # on a GPU, how its generators lay a large draw out: verify can redraw it only on a like GPU
                    **(
                        {"threads": torch.tensor([cuda_draw_threads(self.device)])}
                        if self.device.type == "cuda"
                        else {}
                    ),
                }
            )
        if not projected:
            return
        residual = flat - torch.cat([query.own_sum[name].detach().reshape(-1) for name in space.shapes])
        if space.inputs is not None:
            self._project_inputs(query, space, residual, rate)
        else:
            self._buffer.append((residual, query.max_grad_norm, query.noise_multiplier, rate))
            if len(self._buffer) >= _BUFFER:
                self._flush()

    def _project_inputs(self, query: Query, space: Space, flat: torch.Tensor, rate: float) -> None:
        """Input canaries: each one's gradient at the query's point, normalised, is its direction for this query."""
        if query.model is None:
            raise RuntimeError("An input canary's query view needs the model the query's gradients were taken of.")
        assert space.inputs is not None and space.labels is not None
        grads = per_sample_gradients(
            query.model,
            space.inputs,
            space.labels,
            params={n: query.params[n] for n in space.shapes},
            frozen=query.params,
            loss_fn=space.loss_fn,
        )
        rows = torch.cat([grads[name].detach().reshape(len(self.audit.canaries), -1) for name in space.shapes], 1)
        rows = rows.to(torch.float64)
        norms = rows.norm(dim=1, keepdim=True)
        directions = torch.where(norms > 0, rows / norms.clamp_min(1e-30), torch.zeros_like(rows))
        o = (directions @ flat.to(torch.float64)).unsqueeze(1) / query.max_grad_norm
        sigma = torch.tensor([query.noise_multiplier], dtype=torch.float64, device=o.device)
        self.sum += o[:, 0]
        self.llr += subsampled_gaussian_llr(o, torch.tensor([rate], dtype=torch.float64, device=o.device), sigma)[:, 0]

    def _flush(self) -> None:
        """Project the buffered released sums on every canary direction and add them to the two statistics."""
        if not self._buffer:
            return
        if self._directions is None:
            assert self._space is not None
            ids, shapes = self.audit.canaries, self._space.shapes
            self._directions = [
                _flat_directions(self.audit.seed, chunk, shapes, self.audit.layout).to(self.device)
                for chunk in (ids[i : i + _DIRECTIONS_CHUNK] for i in range(0, len(ids), _DIRECTIONS_CHUNK))
            ]
        released = torch.stack([flat for flat, *_ in self._buffer], dim=1).to(torch.float32)  # [d, k]
        clip = torch.tensor([c for _, c, _, _ in self._buffer], dtype=torch.float64, device=self.device)
        sigma = torch.tensor([s for _, _, s, _ in self._buffer], dtype=torch.float64, device=self.device)
        rate = torch.tensor([q for *_, q in self._buffer], dtype=torch.float64, device=self.device)
        start = 0
        for directions in self._directions:
            o = (directions @ released).to(torch.float64) / clip  # [canaries, k]
            rows = slice(start, start + len(directions))
            self.sum[rows] += o.sum(dim=1)
            self.llr[rows] += subsampled_gaussian_llr(o, rate, sigma).sum(dim=1)
            start += len(directions)
        self._buffer.clear()

    def arrays(self) -> TensorDict:
        """Everything gathered this round, as CPU tensors keyed by name (the client's part of the round's file)."""
        self._flush()
        self._directions = None
        out: TensorDict = {key: torch.tensor(values, dtype=torch.float64) for key, values in self.meta.items()}
        out["canary_ids"] = torch.from_numpy(self.audit.canaries.copy())
        out["sum"], out["llr"] = self.sum.cpu(), self.llr.cpu()
        for index, kept in enumerate(self.kept):
            out.update({f"kept{index}/{name}": t.cpu() for name, t in kept.items()})
        return out


class _DirectionCache:
    """The canaries' directions drawn in this process, kept for the next client and round that ask for the same ones
    (every client of a run projects on every canary's direction, each round: a run with 5,000 canaries drew them 100
    times). Bounded by bytes, least recently used first out; a chunk larger than the bound is drawn each time. The
    rows handed out are shared: readers never write into them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._rows: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._bytes = 0  # held in _rows
        self._lock = threading.Lock()

    def rows(self, seed: int, chunk: np.ndarray, shapes: dict[str, torch.Size], layout: str) -> torch.Tensor:
        key = (seed, layout, tuple((name, tuple(shape)) for name, shape in shapes.items()), chunk.tobytes())
        with self._lock:
            if key in self._rows:
                self._rows.move_to_end(key)
                return self._rows[key]
        rows = canary_rows(seed, chunk, shapes, layout)
        size = rows.numel() * rows.element_size()
        with self._lock:
            if size <= self.max_bytes and key not in self._rows:
                self._rows[key] = rows
                self._bytes += size
                while self._bytes > self.max_bytes:
                    _, dropped = self._rows.popitem(last=False)
                    self._bytes -= dropped.numel() * dropped.element_size()
        return rows


_DIRECTIONS = _DirectionCache(max_bytes=256 * 2**20)


def _flat_directions(seed: int, chunk: np.ndarray, shapes: dict[str, torch.Size], layout: str) -> torch.Tensor:
    """The unit directions u_i of the canaries ``chunk`` in the parameters ``shapes``, one row each, in their order
    (drawn once per process while they fit its cache)."""
    return _DIRECTIONS.rows(seed, np.ascontiguousarray(chunk, dtype=np.int64), shapes, layout)


def subsampled_gaussian_llr(o: torch.Tensor, rate: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """log of the likelihood ratio (1 - q) + q N(o; 1, sigma^2) / N(o; 0, sigma^2) for each projection o (one column
    per query, with its rate q and sigma): the Neyman-Pearson statistic of one query of the Poisson-subsampled
    Gaussian. With sigma 0 a projection is certain evidence; it is clamped to keep the sums finite."""
    z = (2 * o - 1) / (2 * sigma.clamp_min(1e-6) ** 2)
    log_keep = torch.log1p(-rate.clamp(max=1 - 1e-12))
    return torch.logaddexp(log_keep, torch.log(rate) + z).clamp(-1e6, 1e6)


def query_audit(
    *,
    seed: int,
    canary_client: np.ndarray,
    canary_included: np.ndarray,
    client: int,
    kind: str,
    shapes: dict[str, torch.Size],
    clients: int,
    rounds: int,
    client_fraction: float,
    planned_queries: int,
    canary_inputs: torch.Tensor | None = None,
    canary_labels: torch.Tensor | None = None,
    keep_whole: bool = True,
    kept_queries: int = 12,
    layout: str = "model",
) -> QueryAudit:
    """The query audit of one client of a canary run: its canaries (for input canaries ``canary_inputs`` and
    ``canary_labels`` hold the records and labels of every canary, indexed by canary id), and how many pairs of whole
    queries a round keeps, ``kept_queries`` whole queries per run on average; none without ``keep_whole`` (a whole query
    holds the records of its batch, which must not leave a site that keeps its records)."""
    mine = np.flatnonzero(canary_client == client).astype(np.int64)
    held = np.flatnonzero((canary_client == client) & (canary_included == 1)).astype(np.int64)
    expected_client_rounds = max(clients * rounds * client_fraction, 1.0)
    inputs = labels = None
    if kind == "input":
        if canary_inputs is None or canary_labels is None:
            raise ValueError("Input canaries need their records and labels for the query view.")
        index = torch.from_numpy(mine)
        inputs, labels = canary_inputs[index.to(canary_inputs.device)], canary_labels[index.to(canary_labels.device)]
    return QueryAudit(
        seed=seed,
        canaries=mine,
        held=held,
        shapes=dict(shapes),
        keep_pairs=kept_queries / 2 / expected_client_rounds if keep_whole else 0.0,
        planned_queries=max(int(planned_queries), 1),
        inputs=inputs,
        labels=labels,
        layout=layout,
    )

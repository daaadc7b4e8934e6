"""Canary clients (Andrew, Kairouz, Oh et al., ICLR 2024, "One-shot empirical privacy estimation for federated
learning"): clients whose update is a random direction, each included in the population with probability 1/2,
sampled and clipped like the real clients. The cosine of every round's released update, and of the final model minus
the initial one, with every canary's direction is what the audit scores (``attacks/canary/flower_log.py``). NumPy
only: a Flower app imports it through :mod:`fedaudit.flower`.

One implementation for both places canary clients live: a Flower app's strategy wrapper
(:class:`fedaudit.flower.CanaryClients`) and fedaudit's own client-level DP runs (``--canary-clients``,
:class:`RunCanaries`), which write the same log (:mod:`fedaudit.instruments.canary_log`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import fedaudit
from fedaudit.instruments.canary_log import CanaryLog
from fedaudit.seeding import Stream, numpy_rng

CANARY_SCALE = 10.0  # a canary's update norm before clipping, in units of the clipping norm
_CACHED_ENTRIES = 1 << 24  # directions held in memory up to m * d entries (128 MB); beyond, drawn again per use
_BLOCK = 256  # canaries drawn at once when the directions are not held


def draw_inclusion(canaries: int, seed: int) -> np.ndarray:
    """The inclusion bits of ``canaries`` canaries drawn from ``seed`` (int8, probability 1/2 each)."""
    return (numpy_rng(seed, Stream.CANARY_DRAW).random(canaries) < 0.5).astype(np.int8)


class CanarySpace:
    """The space the canaries live in and what the log keeps of it: the initial and the latest model as one float64
    vector, the canaries' unit directions (each from its own stream (seed, CANARY, i), uniform on the sphere), and
    one row per round (the cosines of the released update with every canary's direction)."""

    def __init__(self, seed: int, canaries: int) -> None:
        self.seed = seed
        self.canaries = canaries
        self.initial: np.ndarray | None = None
        self.latest: np.ndarray | None = None
        self._directions: np.ndarray | None = None
        self.rows: list[dict[str, Any]] = []

    def begin(self, initial: np.ndarray) -> None:
        """The initial model, once (later calls keep the first)."""
        if self.initial is not None:
            return
        self.initial = self.latest = initial
        if self.canaries * initial.size <= _CACHED_ENTRIES:
            self._directions = self._draw(np.arange(self.canaries))

    @property
    def dimension(self) -> int:
        return 0 if self.initial is None else int(self.initial.size)

    def _draw(self, indices: np.ndarray) -> np.ndarray:
        rows = np.empty((len(indices), self.dimension))
        for row, i in enumerate(indices):
            direction = numpy_rng(self.seed, Stream.CANARY, int(i)).standard_normal(self.dimension)
            rows[row] = direction / np.linalg.norm(direction)
        return rows

    def directions(self, indices: np.ndarray) -> np.ndarray:
        """Unit directions of canaries ``indices`` (held in memory when they fit)."""
        return self._directions[indices] if self._directions is not None else self._draw(indices)

    def cosines(self, vector: np.ndarray) -> np.ndarray:
        """cos(vector, u_i) for every canary i (0 for the zero vector)."""
        norm = float(np.linalg.norm(vector))
        if norm == 0.0:
            return np.zeros(self.canaries)
        out = np.empty(self.canaries)
        for start in range(0, self.canaries, _BLOCK):
            block = np.arange(start, min(start + _BLOCK, self.canaries))
            out[block] = self.directions(block) @ vector / norm
        return np.clip(out, -1.0, 1.0)

    def record(
        self,
        before: np.ndarray,
        after: np.ndarray | None,
        *,
        sampled: int,
        population: int,
        equal: bool,
        sample_rate: float = math.nan,
    ) -> None:
        """The round's row: the update released (``after``, None when no model was released) against the model the
        round began from."""
        released = after is not None
        if released:
            self.latest = after
        update = self.latest - before if released else np.zeros_like(before)
        self.rows.append(
            {
                "cosines": self.cosines(update),
                "norm": float(np.linalg.norm(update)),
                "released": int(released),
                "sampled": sampled,
                "population": population,
                "equal_weights": int(equal),
                "sample_rate": float(sample_rate),
            }
        )

    def columns(self) -> dict[str, np.ndarray]:
        """The rows as the log's per-round arrays."""
        return {name: np.array([row[name] for row in self.rows]) for name in self.rows[0]}

    def log(self, **settings: Any) -> CanaryLog:
        """The log of the rounds so far: the rounds' rows and the final model's cosines, with ``settings`` (the
        mechanism's, the inclusion bits, what Flower reports)."""
        assert self.initial is not None and self.latest is not None and self.rows
        final = self.latest - self.initial
        column = self.columns()
        return CanaryLog(
            dimension=self.dimension,
            round_cosines=np.stack(column["cosines"]),
            round_norms=column["norm"],
            released=column["released"],
            sampled=column["sampled"],
            population=column["population"],
            equal_weights=column["equal_weights"],
            final_cosines=self.cosines(final),
            final_norm=float(np.linalg.norm(final)),
            sample_rate=column["sample_rate"],
            fedaudit_version=fedaudit.__version__,
            **settings,
        )


class RunCanaries:
    """The canary clients of a client-level DP run (``--canary-clients m``): canary i, if included, is sampled by the
    server with the real clients' probability q and sends ``CANARY_SCALE`` C u_i, which the server's clipping brings
    to C u_i; the run's log (``canary-clients.npz``) gets every round's cosines."""

    def __init__(self, count: int, seed: int, *, clipping_norm: float, noise_multiplier: float, delta: float) -> None:
        self.seed, self.clipping_norm, self.noise_multiplier, self.delta = seed, clipping_norm, noise_multiplier, delta
        self.included = draw_inclusion(count, seed)
        self.space = CanarySpace(seed, count)

    @property
    def count(self) -> int:
        return int(self.included.size)

    @property
    def population(self) -> int:
        """Included canary clients: they join the population the server samples from."""
        return int(self.included.sum())

    def sampled(self, uniforms: np.ndarray, sample_rate: float) -> np.ndarray:
        """The canaries a round samples: included, and their uniform (one per canary, drawn by the server with the
        real clients') below q."""
        return np.flatnonzero(self.included.astype(bool) & (uniforms < sample_rate))

    def updates(self, indices: np.ndarray) -> np.ndarray:
        """What sampled canaries ``indices`` send, one row each in the flattened space of the model's parameters:
        ``CANARY_SCALE`` C u_i."""
        if not len(indices):
            return np.zeros((0, self.space.dimension))
        return CANARY_SCALE * self.clipping_norm * self.space.directions(indices)

    def record(self, before: np.ndarray, after: np.ndarray, sampled: int, population: int, rate: float) -> None:
        """A round's row: the released update (every update weighs the same), ``sampled`` clients of ``population``
        (canary clients counted in both; fedaudit's own runs give 0, the count being the server's secret sample),
        each sampled with probability ``rate``."""
        self.space.record(before, after, sampled=sampled, population=population, equal=True, sample_rate=rate)

    def to_log(self, *, strategy: str) -> CanaryLog:
        """The log of the rounds so far."""
        return self.space.log(
            seed=self.seed,
            included=self.included,
            scale=CANARY_SCALE,
            clipping_norm=self.clipping_norm,
            noise_multiplier=self.noise_multiplier,
            mechanism="central DP (fedaudit client level)",
            strategy=strategy,
            delta=self.delta,
            flower_epsilon=math.nan,
            flower_delta=math.nan,
            flower_report="not a Flower app: fedaudit's own client-level DP run",
            flower_version="",
        )

    def resumed(self, log: CanaryLog, rounds: int, initial: np.ndarray, latest: np.ndarray) -> None:
        """Continue from a run's log after ``rounds`` committed rounds (the log may hold one more)."""
        self.space.begin(initial)
        self.space.latest = latest
        for t in range(rounds):
            self.space.rows.append(
                {
                    "cosines": log.round_cosines[t].copy(),
                    "norm": float(log.round_norms[t]),
                    "released": int(log.released[t]),
                    "sampled": int(log.sampled[t]),
                    "population": int(log.population[t]),
                    "equal_weights": int(log.equal_weights[t]),
                    "sample_rate": float(log.sample_rate[t]),
                }
            )

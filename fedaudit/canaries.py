"""Gradient canaries: records planted at training time so that a canary audit can bound epsilon from one run.

Canary i is a fixed random unit direction u_i in parameter space (the model's parameters in their order, flattened),
drawn from the run's seed. It is included with probability 1/2, independently of the others, and then belongs to
one client's data: in each of that client's DP queries it is Poisson-sampled with the client's rate q like every
record, and when sampled its per-example gradient is C u_i, clipped (a no-op: its norm is C) and noised with the
batch by the one DP primitive. Training reads only which canaries its clients hold; the inclusion bits are written
to canaries.npz for the audit. Canaries are records: the accountant's epsilon covers them unchanged.
See docs/audit.md (canary audits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedaudit.seeding import Stream, make_generator, numpy_rng


@dataclass(frozen=True)
class Canaries:
    """The canaries of a run: kind, inclusion bits (secret), the client each belongs to, and the seed that draws
    their directions."""

    kind: str
    seed: int
    included: np.ndarray  # int8, one bit per canary
    client: np.ndarray  # int64, the client whose data holds the canary when it is included

    @classmethod
    def draw(cls, *, count: int, kind: str, seed: int, num_clients: int) -> Canaries:
        """Inclusion bits (probability 1/2 each) and clients (uniform), from the run's seed."""
        rng = numpy_rng(seed, Stream.CANARY_DRAW)
        included = (rng.random(count) < 0.5).astype(np.int8)
        client = rng.integers(0, num_clients, count).astype(np.int64)
        return cls(kind=kind, seed=seed, included=included, client=client)

    @property
    def count(self) -> int:
        return int(len(self.included))

    def held_by(self, client: int) -> np.ndarray:
        """Indices of the canaries included in ``client``'s data (training reads nothing else)."""
        return np.flatnonzero((self.included == 1) & (self.client == client))

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {
            "kind": np.array(self.kind),
            "seed": np.array(self.seed, dtype=np.int64),
            "included": self.included,
            "client": self.client,
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Canaries:
        return cls(
            kind=str(arrays["kind"]),
            seed=int(arrays["seed"]),
            included=arrays["included"].astype(np.int8),
            client=arrays["client"].astype(np.int64),
        )


def canary_directions(
    seed: int, indices: np.ndarray, shapes: dict[str, torch.Size], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Unit directions u_i of the canaries ``indices``, split by parameter: name -> [len(indices), *shape].

    Each direction is drawn on the CPU from its own stream (seed, CANARY, i), so it is the same whichever client,
    device or engine asks for it.
    """
    total = sum(int(torch.Size(shape).numel()) for shape in shapes.values())
    rows = torch.empty(len(indices), total)
    for row, i in enumerate(indices):
        direction = torch.randn(total, generator=make_generator(seed, Stream.CANARY, int(i)))
        rows[row] = direction / direction.norm()
    split, start = {}, 0
    for name, shape in shapes.items():
        size = int(torch.Size(shape).numel())
        split[name] = rows[:, start : start + size].reshape(len(indices), *shape).to(device)
        start += size
    return split

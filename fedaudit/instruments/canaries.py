"""Canaries: records planted at training time so that a canary audit can bound epsilon from one run.

Each canary is included with probability 1/2, independently of the others, and then belongs to one client's data:
in each of that client's DP queries it is Poisson-sampled with the client's rate q = B / N_k (N_k its own records)
like every record, and clipped and noised with the batch by the one DP primitive. Two kinds:

- gradient (white-box, the server's view): canary i is a fixed random unit direction u_i in parameter space (the
  model's parameters in their order, flattened), drawn from the run's seed. In the "parts" layout (runs since
  canaries in every part of the model) every other canary spans the whole model and the rest lie inside one part
  each, in turn: a single parameter tensor, a layer (the tensors of one module) or a kind of parameter (every
  tensor of one name, as every bias), so that a clipping that leaves a part unbounded moves that part's canaries
  (:func:`canary_groups`). Older runs' canaries all span the model (layout "model"). Its per-example gradient is
  GRADIENT_CANARY_NORM * C * u_i, ten times the clipping norm, so that clipping is part of what is audited: a
  correct query clips it to C u_i like any large gradient, and one that skips clipping lets ten times as much
  through, which the audit sees.
- input (black-box, the final model): canary i is a held-out record that no client owns, with its label replaced
  by another class the client holds, so that it is atypical; it is an ordinary record in every query.

Training reads only which canaries its clients hold; the inclusion bits are written to canaries.npz for the audit.
Canaries are records: the accountant's epsilon covers them unchanged. See docs/audit.md (canary audits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedaudit.seeding import Stream, derive_seeds, numpy_rng

GRADIENT_CANARY_NORM = 10.0  # a gradient canary's per-example gradient norm, in units of the clipping norm C
LAYOUTS = ("model", "parts")  # where gradient canaries' directions lie: the whole model, or parts of it in turn
# Canaries a part needs before a run lays them out in parts: fewer leave each part too few to prove anything, and
# cost the bound over all canaries its power (500 canaries on a 4-tensor MLP: the query view caught the canaries'
# norm taken without one tensor in 8 of 10 runs with every canary over the model, in 0 of 10 with parts).
CANARIES_PER_PART = 100


@dataclass(frozen=True)
class CanaryGroup:
    """A part of the model that canaries of the "parts" layout lie in: its name and its parameters' names."""

    name: str  # "model", "tensor NAME", "layer MODULE" or "kind NAME" (every tensor whose name ends so)
    members: tuple[str, ...]


def canary_groups(names: Sequence[str]) -> tuple[CanaryGroup, ...]:
    """The parts of a model whose parameters are ``names`` (in order): the whole model, each tensor, each layer of
    two tensors or more, and each kind of parameter (the last part of the name) that two tensors or more share
    and not all."""
    names = list(names)
    layers: dict[str, list[str]] = {}
    kinds: dict[str, list[str]] = {}
    for name in names:
        module, _, kind = name.rpartition(".")
        if module:
            layers.setdefault(module, []).append(name)
        kinds.setdefault(kind, []).append(name)
    groups = [CanaryGroup("model", tuple(names))]
    groups += [CanaryGroup(f"tensor {name}", (name,)) for name in names]
    groups += [CanaryGroup(f"layer {module}", tuple(members)) for module, members in layers.items() if len(members) > 1]
    groups += [
        CanaryGroup(f"kind {kind}", tuple(members)) for kind, members in kinds.items() if 1 < len(members) < len(names)
    ]
    return tuple(groups)


def layout_for(count: int, names: Sequence[str]) -> str:
    """ "parts" when ``count`` gradient canaries give every part but the whole model :data:`CANARIES_PER_PART` of
    its own (half of them span the model), else "model"."""
    others = len(canary_groups(names)) - 1
    return "parts" if others and count // 2 >= CANARIES_PER_PART * others else "model"


def group_of(index: int, groups: Sequence[CanaryGroup]) -> CanaryGroup:
    """Canary ``index``'s part in the "parts" layout: even canaries span the whole model, odd ones go round the
    other parts in turn."""
    if index % 2 == 0 or len(groups) == 1:
        return groups[0]
    return groups[1 + (index // 2) % (len(groups) - 1)]


@dataclass(frozen=True)
class Canaries:
    """The canaries of a run: kind, inclusion bits (secret), the client each belongs to, and the seed that draws
    their directions."""

    kind: str
    seed: int
    included: np.ndarray  # int8, one bit per canary
    client: np.ndarray  # int64, the client whose data holds the canary when it is included
    record: np.ndarray | None = None  # input canaries: int64 index of the held-out training record
    label: np.ndarray | None = None  # input canaries: int64 label it is trained with (not its own)
    layout: str = "model"  # gradient canaries: where their directions lie (LAYOUTS; "model" for older runs)

    @classmethod
    def draw(
        cls,
        *,
        count: int,
        kind: str,
        seed: int,
        num_clients: int,
        holdout: np.ndarray | None = None,
        labels: np.ndarray | None = None,
        client_classes: list[np.ndarray] | None = None,
        layout: str = "model",
    ) -> Canaries:
        """Inclusion bits (probability 1/2 each) and clients (uniform), from the run's seed; input canaries also
        draw distinct records of ``holdout`` and, for each, a label among its client's ``client_classes`` other
        than the record's own ``labels`` entry (any other class when the client holds only that one)."""
        rng = numpy_rng(seed, Stream.CANARY_DRAW)
        included = (rng.random(count) < 0.5).astype(np.int8)
        client = rng.integers(0, num_clients, count).astype(np.int64)
        if kind != "input":
            return cls(kind=kind, seed=seed, included=included, client=client, layout=layout)
        if holdout is None or labels is None or client_classes is None:
            raise ValueError("input canaries are drawn from the held-out pool: pass holdout, labels, client_classes.")
        record = np.sort(rng.choice(holdout, size=count, replace=False)).astype(np.int64)
        num_classes = int(max(labels.max(), *(c.max(initial=0) for c in client_classes))) + 1
        label = np.empty(count, dtype=np.int64)
        for i, (r, k) in enumerate(zip(record, client)):
            own = int(labels[r])
            choices = client_classes[k][client_classes[k] != own]
            if choices.size == 0:
                choices = np.array([c for c in range(num_classes) if c != own])
            label[i] = int(rng.choice(choices))
        return cls(kind=kind, seed=seed, included=included, client=client, record=record, label=label)

    @property
    def count(self) -> int:
        return int(len(self.included))

    def held_by(self, client: int) -> np.ndarray:
        """Indices of the canaries included in ``client``'s data (training reads nothing else)."""
        return np.flatnonzero((self.included == 1) & (self.client == client))

    def to_arrays(self) -> dict[str, np.ndarray]:
        arrays = {
            "kind": np.array(self.kind),
            "seed": np.array(self.seed, dtype=np.int64),
            "included": self.included,
            "client": self.client,
        }
        if self.layout != "model":
            arrays["layout"] = np.array(self.layout)
        if self.record is not None and self.label is not None:
            arrays.update(record=self.record, label=self.label)
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Canaries:
        return cls(
            kind=str(arrays["kind"]),
            seed=int(arrays["seed"]),
            included=arrays["included"].astype(np.int8),
            client=arrays["client"].astype(np.int64),
            record=arrays["record"].astype(np.int64) if "record" in arrays else None,
            label=arrays["label"].astype(np.int64) if "label" in arrays else None,
            layout=str(arrays["layout"]) if "layout" in arrays else "model",
        )


def canary_rows(seed: int, indices: np.ndarray, shapes: dict[str, torch.Size], layout: str = "model") -> torch.Tensor:
    """Unit directions u_i of the canaries ``indices`` as rows over the parameters ``shapes`` (in their order), on the
    CPU: [len(indices), total].

    Each direction is drawn from its own stream (seed, CANARY, i), so it is the same whichever client, device or
    engine asks for it; in the "parts" layout its coordinates outside canary i's part (:func:`group_of`) are set to
    zero before it is normalised. The seeds are derived for all canaries at once and one generator is reseeded for
    each (the same draws as a generator per canary, without a generator's and a seed's set-up per canary).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown canary layout {layout!r}.")
    total = sum(int(torch.Size(shape).numel()) for shape in shapes.values())
    groups = canary_groups(list(shapes)) if layout == "parts" else ()
    masks: dict[str, torch.Tensor] = {}
    rows = torch.empty(len(indices), total)
    seeds = derive_seeds(seed, Stream.CANARY, np.asarray(indices, dtype=np.int64)).tolist()
    generator = torch.Generator()
    for row, i in enumerate(indices):
        generator.manual_seed(seeds[row])
        direction = rows[row]
        torch.randn(total, generator=generator, out=direction)
        if groups:
            group = group_of(int(i), groups)
            if group.name not in masks:
                masks[group.name] = torch.cat(
                    [
                        torch.full((int(torch.Size(shape).numel()),), name in group.members)
                        for name, shape in shapes.items()
                    ]
                )
            direction.mul_(masks[group.name])
        direction.div_(torch.linalg.vector_norm(direction))
    return rows


def canary_directions(
    seed: int,
    indices: np.ndarray,
    shapes: dict[str, torch.Size],
    device: torch.device | str = "cpu",
    layout: str = "model",
) -> dict[str, torch.Tensor]:
    """Unit directions u_i of the canaries ``indices`` (:func:`canary_rows`), split by parameter: name ->
    [len(indices), *shape] on ``device``."""
    rows = canary_rows(seed, indices, shapes, layout)
    split, start = {}, 0
    for name, shape in shapes.items():
        size = int(torch.Size(shape).numel())
        split[name] = rows[:, start : start + size].reshape(len(indices), *shape).to(device)
        start += size
    return split

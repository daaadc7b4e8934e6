"""Partitioners that split a training set among federated clients, and the membership split.

First a stratified holdout pool is drawn from the training set: records no
client ever sees, the non-members of a membership-inference audit. The rest is
divided among the clients by one of three schemes:

- ``iid``: a uniform shuffle split into near-equal parts;
- ``classes:K``: each client holds K classes (the pathological non-IID split
  of FedAvg / FedLAP-DP papers, e.g. 5 clients x 2 classes);
- ``dirichlet:ALPHA``: per-class client proportions drawn from
  Dirichlet(ALPHA); small ALPHA is skewed, large ALPHA near-uniform.

Every random choice comes from ``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedaudit.data.readers import DataError

__all__ = [
    "Partition",
    "PartitionError",
    "partition_dataset",
    "validate_partition_spec",
]

_DIRICHLET_MAX_DRAWS = 1000
_DIRICHLET_MIN_RECORDS = 10
_SPEC_HELP = "use 'iid', 'classes:K' (integer K >= 1) or 'dirichlet:ALPHA' (number ALPHA > 0)"


# membership.npz of sites that keep their records (data.sites) also holds these: not part of the partition
SITE_KEYS = ("member_hashes_", "heldout_hashes_", "site_records")


class PartitionError(DataError):
    """A partitioning request that cannot be met; ``str(error)`` is one sentence saying why and what to change."""


def _as_index_array(value: object, key: str) -> np.ndarray:
    """Validate one index array: 1-D, integer, non-negative, strictly increasing; return it as read-only int64."""
    array = np.asarray(value)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise PartitionError(
            f"{key} must be a 1-D array of integer indices, got dtype {array.dtype} and shape {array.shape}."
        )
    array = np.array(array, dtype=np.int64)
    if array.size and array[0] < 0:
        raise PartitionError(f"{key} contains negative indices.")
    if np.any(np.diff(array) <= 0):
        raise PartitionError(f"{key} must be sorted and free of duplicates.")
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Partition:
    """Which training records each client holds, and which are held out from every client.

    ``clients[k]`` and ``holdout`` are sorted int64 indices into the training
    split; they are pairwise disjoint. Clients are the members of the
    federation's training data, ``holdout`` is the non-member pool for
    membership auditing. The arrays are read-only.
    """

    clients: tuple[np.ndarray, ...]
    holdout: np.ndarray

    def __post_init__(self) -> None:
        """Validate and freeze the index arrays."""
        if len(self.clients) == 0:
            raise PartitionError("a partition needs at least one client.")
        clients = tuple(_as_index_array(c, f"client_{k}") for k, c in enumerate(self.clients))
        holdout = _as_index_array(self.holdout, "holdout")
        for k, indices in enumerate(clients):
            if indices.size == 0:
                raise PartitionError(f"client_{k} holds no records; every client needs at least one.")
        everything = np.concatenate((*clients, holdout))
        if np.unique(everything).size != everything.size:
            raise PartitionError("client and holdout index sets must be disjoint, but some indices appear twice.")
        object.__setattr__(self, "clients", clients)
        object.__setattr__(self, "holdout", holdout)

    @property
    def num_clients(self) -> int:
        """The number of clients."""
        return len(self.clients)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The arrays ``membership.npz`` stores: ``client_0`` .. ``client_{K-1}`` and ``holdout``."""
        arrays = {f"client_{k}": indices for k, indices in enumerate(self.clients)}
        arrays["holdout"] = self.holdout
        return arrays

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Partition:
        """Rebuild a partition from :meth:`to_arrays` output (e.g. a loaded ``membership.npz``).

        Raises:
            PartitionError: missing, extra or misnumbered keys, or arrays that
                are not sorted, disjoint, non-negative integer indices.
        """
        keys = {key for key in arrays if not key.startswith(SITE_KEYS)}  # a federation's sites
        if "holdout" not in keys:
            raise PartitionError("membership arrays lack 'holdout'; the file is not a fedaudit membership split.")
        client_keys = keys - {"holdout"}
        expected = {f"client_{k}" for k in range(len(client_keys))}
        if not client_keys or client_keys != expected:
            found = ", ".join(sorted(client_keys)) or "none"
            raise PartitionError(
                f"membership arrays must hold client_0 .. client_{{K-1}} and holdout, found clients: {found}."
            )
        clients = tuple(arrays[f"client_{k}"] for k in range(len(client_keys)))
        return cls(clients=clients, holdout=arrays["holdout"])

    def __repr__(self) -> str:
        """Summarise sizes rather than printing indices."""
        sizes = ", ".join(str(c.size) for c in self.clients)
        return f"Partition(clients=[{sizes}], holdout={self.holdout.size})"


def validate_partition_spec(spec: str) -> str:
    """Check a partition scheme and return it in normal form.

    Example:
        >>> validate_partition_spec(" Classes:02 "), validate_partition_spec("dirichlet:1")
        ('classes:2', 'dirichlet:1.0')
    """
    if not isinstance(spec, str):
        raise PartitionError(f"partition scheme must be a string; {_SPEC_HELP}.")
    text = spec.strip().lower()
    kind, sep, param = text.partition(":")
    param = param.strip()
    if kind == "iid" and not sep:
        return "iid"
    if kind == "classes" and sep:
        try:
            k = int(param)
        except ValueError:
            raise PartitionError(f"partition scheme {spec!r} has a malformed class count; {_SPEC_HELP}.") from None
        if k < 1:
            raise PartitionError(f"partition scheme {spec!r} needs at least one class per client; {_SPEC_HELP}.")
        return f"classes:{k}"
    if kind == "dirichlet" and sep:
        try:
            alpha = float(param)
        except ValueError:
            raise PartitionError(f"partition scheme {spec!r} has a malformed concentration; {_SPEC_HELP}.") from None
        if not (math.isfinite(alpha) and alpha > 0):
            raise PartitionError(f"partition scheme {spec!r} needs a finite ALPHA > 0; {_SPEC_HELP}.")
        return f"dirichlet:{alpha!r}"
    raise PartitionError(f"unknown partition scheme {spec!r}; {_SPEC_HELP}.")


def _draw_holdout(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Draw a per-class random ``fraction`` of the records, keeping at least one record of each class out of it."""
    chosen: list[np.ndarray] = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        count = min(math.floor(fraction * members.size + 0.5), members.size - 1)
        chosen.append(rng.permutation(members)[:count])
    return np.sort(np.concatenate(chosen))


def _split_iid(pool: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle the pool and cut it into near-equal parts."""
    return list(np.array_split(rng.permutation(pool), num_clients))


def _split_classes(
    pool: np.ndarray, labels: np.ndarray, num_clients: int, per_client: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """Give each client ``per_client`` distinct classes; return the client parts and the unassigned records.

    Classes are dealt round-robin from a seeded permutation: disjoint when
    ``per_client * num_clients <= num_classes``, otherwise each class is shared
    by the clients dealt it and its records are split evenly among them.
    """
    classes = np.unique(labels[pool])
    if per_client > classes.size:
        raise PartitionError(
            f"classes:{per_client} asks for more classes per client than the {classes.size} the data has; "
            f"use classes:K with K <= {classes.size}."
        )
    order = rng.permutation(classes)
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for client in range(num_clients):
        for j in range(per_client):
            holders[int(order[(client * per_client + j) % classes.size])].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    unassigned: list[np.ndarray] = []
    for cls in classes:
        records = rng.permutation(pool[labels[pool] == cls])
        owners = holders[int(cls)]
        if not owners:
            unassigned.append(records)
            continue
        for owner, share in zip(owners, np.array_split(records, len(owners))):
            parts[owner].append(share)
    empty = np.empty(0, dtype=np.int64)
    return [np.concatenate(p) if p else empty for p in parts], np.concatenate(unassigned) if unassigned else empty


def _split_dirichlet(
    pool: np.ndarray, labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Per class, split records among clients in Dirichlet(alpha)-distributed proportions.

    Proportions are redrawn (at most ``_DIRICHLET_MAX_DRAWS`` times) until
    every client holds at least ``min(10, len(pool) // num_clients)`` records.
    """
    classes = np.unique(labels[pool])
    by_class = [rng.permutation(pool[labels[pool] == cls]) for cls in classes]
    sizes = np.array([records.size for records in by_class], dtype=np.int64)
    minimum = min(_DIRICHLET_MIN_RECORDS, pool.size // num_clients)
    for _ in range(_DIRICHLET_MAX_DRAWS):
        proportions = rng.dirichlet(np.full(num_clients, alpha), size=classes.size)
        cuts = np.floor(np.cumsum(proportions, axis=1)[:, :-1] * sizes[:, None]).astype(np.int64)
        column = sizes[:, None]
        bounds = np.concatenate([np.zeros_like(column), np.minimum(cuts, column), column], axis=1)
        if np.diff(bounds, axis=1).sum(axis=0).min() >= minimum:
            return [
                np.concatenate([records[bounds[c, k] : bounds[c, k + 1]] for c, records in enumerate(by_class)])
                for k in range(num_clients)
            ]
    raise PartitionError(
        f"dirichlet:{alpha!r} did not give each of {num_clients} clients at least {minimum} records in "
        f"{_DIRICHLET_MAX_DRAWS} draws; use a larger ALPHA or fewer clients."
    )


def partition_dataset(
    labels: np.ndarray, *, num_clients: int, scheme: str, seed: int, holdout_fraction: float = 0.1
) -> Partition:
    """Split the training set among ``num_clients`` clients after drawing a stratified holdout pool.

    Args:
        labels: 1-D integer class labels of the training split.
        num_clients: number of clients, at least 1.
        scheme: ``"iid"``, ``"classes:K"`` or ``"dirichlet:ALPHA"``.
        seed: seed of ``numpy.random.default_rng``; the same seed gives the same partition.
        holdout_fraction: fraction of each class (0 <= f < 1) kept from every
            client as membership non-members; each class keeps at least one member record.

    Returns:
        A :class:`Partition` whose clients and holdout cover every training
        index exactly once. Under ``classes:K`` with ``K * num_clients`` below
        the number of classes, the classes no client is dealt go to the holdout
        pool too, so it then also holds classes no client trained on.

    Raises:
        PartitionError: bad arguments, or a client that would end up empty.

    Example:
        >>> part = partition_dataset(np.repeat(np.arange(10), 20), num_clients=5, scheme="classes:2", seed=0)
        >>> part.num_clients, sorted(len(c) for c in part.clients), part.holdout.size
        (5, [36, 36, 36, 36, 36], 20)
    """
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer) or array.min() < 0:
        raise PartitionError("labels must be a non-empty 1-D array of non-negative integer class ids.")
    array = array.astype(np.int64, copy=False)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise PartitionError(f"num_clients must be an integer >= 1, got {num_clients!r}.")
    num_clients = int(num_clients)
    if num_clients > array.size:
        raise PartitionError(f"cannot split {array.size} records among {num_clients} clients; use fewer clients.")
    try:
        fraction = float(holdout_fraction)
    except (TypeError, ValueError):
        raise PartitionError(f"holdout_fraction must be a number in [0, 1), got {holdout_fraction!r}.") from None
    if not 0.0 <= fraction < 1.0:
        raise PartitionError(f"holdout_fraction must be in [0, 1), got {holdout_fraction!r}.")
    try:
        seed_value = operator.index(seed)
    except TypeError:
        raise PartitionError(f"seed must be a non-negative integer, got {seed!r}.") from None
    if seed_value < 0:
        raise PartitionError(f"seed must be a non-negative integer, got {seed!r}.")
    normalised = validate_partition_spec(scheme)

    rng = np.random.default_rng(seed_value)
    holdout = _draw_holdout(array, fraction, rng)
    in_pool = np.ones(array.size, dtype=bool)
    in_pool[holdout] = False
    pool = np.flatnonzero(in_pool)

    kind, _, param = normalised.partition(":")
    if kind == "iid":
        parts = _split_iid(pool, num_clients, rng)
    elif kind == "classes":
        parts, unassigned = _split_classes(pool, array, num_clients, int(param), rng)
        holdout = np.sort(np.concatenate((holdout, unassigned)))
    else:
        parts = _split_dirichlet(pool, array, num_clients, float(param), rng)

    for k, part in enumerate(parts):
        if part.size == 0:
            raise PartitionError(
                f"client {k} ends up with no records under {normalised} with {num_clients} clients and "
                f"holdout_fraction {fraction}; use fewer clients or another scheme."
            )
    return Partition(clients=tuple(np.sort(p) for p in parts), holdout=holdout)

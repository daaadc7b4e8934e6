"""Evaluation sets of a membership audit: balanced, disjoint members and non-members drawn from membership.npz.

Members are records some client trained on, drawn uniformly from the union of
all clients. Non-members are records no client saw: the held-out pool of the
training split, the test split, or both. Non-members are restricted to the
classes the members have: with a ``classes:K`` partition the holdout may hold
classes no client trained on, and comparing those with members would measure
the class, not membership. Both sides get the same number of records, and each
side is split into an attack-training half and an audit half (used by the
methods that fit something on the signal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedaudit.attacks import AttackError, Draw
from fedaudit.attacks.options import DEFAULT_MAX_RECORDS, NONMEMBER_SOURCES
from fedaudit.data import Partition
from fedaudit.seeding import Stream, numpy_rng


@dataclass(frozen=True, eq=False)
class EvaluationSet:
    """The records of an audit, members first; every array has one entry per record.

    ``source`` is "train" or "test" and ``index`` the record's index in that split;
    ``client`` is the member's client (-1 for non-members); ``attack_train`` marks
    the attack-training half of each side. ``client_classes[k]`` are the labels
    client k holds (for per-client results that compare like with like).
    """

    source: np.ndarray
    index: np.ndarray
    label: np.ndarray
    member: np.ndarray
    client: np.ndarray
    attack_train: np.ndarray
    client_classes: dict[int, np.ndarray]
    # what a client's members are compared with in per-client results: the non-members of the same group (None:
    # of the client's classes, by label; a sites run: of the client's own site, whose ids are the groups)
    group: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.member.size)

    @property
    def num_members(self) -> int:
        return int(self.member.sum())

    @property
    def num_nonmembers(self) -> int:
        return len(self) - self.num_members


def build_evaluation_set(
    partition: Partition,
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    *,
    nonmembers: str = "both",
    max_records: int = DEFAULT_MAX_RECORDS,
    seed: int,
    exclude: np.ndarray | None = None,
) -> EvaluationSet:
    """Draw min(#members, #non-members, ``max_records``) records on each side, reproducibly from ``seed``.

    ``exclude`` are held-out records that must not serve as non-members (a run's input canaries).

    Raises:
        AttackError: an unknown ``nonmembers`` source, a non-positive ``max_records``,
            or fewer than two records on either side.
    """
    if nonmembers not in NONMEMBER_SOURCES:
        raise AttackError(f"Unknown non-member source {nonmembers!r}; choose one of: {', '.join(NONMEMBER_SOURCES)}.")
    if max_records < 2:
        raise AttackError(f"--max-records must be at least 2 (records per side), got {max_records}.")
    member_index = np.concatenate(partition.clients)
    member_client = np.concatenate([np.full(c.size, k) for k, c in enumerate(partition.clients)])
    member_classes = np.unique(train_labels[member_index])

    pools = []
    if nonmembers in ("holdout", "both"):
        holdout = partition.holdout if exclude is None else np.setdiff1d(partition.holdout, exclude)
        pools.append(("train", holdout, train_labels[holdout]))
    if nonmembers in ("test", "both"):
        pools.append(("test", np.arange(test_labels.size), test_labels))
    pool_source = np.concatenate([np.full(idx.size, src) for src, idx, _ in pools])
    pool_index = np.concatenate([idx for _, idx, _ in pools])
    pool_label = np.concatenate([lab for _, _, lab in pools])
    like = np.isin(pool_label, member_classes)
    pool_source, pool_index, pool_label = pool_source[like], pool_index[like], pool_label[like]

    per_side = min(member_index.size, pool_index.size, max_records)
    if per_side < 2:
        raise AttackError(
            f"An audit needs at least 2 members and 2 non-members of the members' classes, but the run has "
            f"{member_index.size} members and {pool_index.size} such non-members ({nonmembers}); try --nonmembers both."
        )
    chosen_members = np.sort(
        numpy_rng(seed, Stream.ATTACK, Draw.MEMBERS).choice(member_index.size, per_side, replace=False)
    )
    chosen_pool = np.sort(
        numpy_rng(seed, Stream.ATTACK, Draw.NONMEMBERS).choice(pool_index.size, per_side, replace=False)
    )

    split_rng = numpy_rng(seed, Stream.ATTACK, Draw.HALVES)
    halves = [split_rng.permutation(per_side) < per_side // 2 for _ in range(2)]
    return EvaluationSet(
        source=np.concatenate([np.full(per_side, "train"), pool_source[chosen_pool]]).astype(str),
        index=np.concatenate([member_index[chosen_members], pool_index[chosen_pool]]).astype(np.int64),
        label=np.concatenate([train_labels[member_index[chosen_members]], pool_label[chosen_pool]]).astype(np.int64),
        member=np.repeat(np.array([1, 0], dtype=np.int8), per_side),
        client=np.concatenate([member_client[chosen_members], np.full(per_side, -1)]).astype(np.int64),
        attack_train=np.concatenate(halves),
        client_classes={k: np.unique(train_labels[c]) for k, c in enumerate(partition.clients)},
    )

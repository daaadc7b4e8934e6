"""The evaluation set: members, non-members and the two halves."""

from __future__ import annotations

import numpy as np
import pytest

from fedaudit.attacks import AttackError
from fedaudit.attacks.membership.evaluation import build_evaluation_set
from fedaudit.data import Partition

# ---------------------------------------------------------------------------- evaluation sets


def digits_like(seed: int = 0) -> tuple[Partition, np.ndarray, np.ndarray]:
    """1000 train records of 10 classes (client 0: classes 0-1, client 1: classes 2-3, holdout: every class), 300
    test."""
    rng = np.random.default_rng(seed)
    train_y = np.repeat(np.arange(10), 100)
    test_y = rng.integers(0, 10, 300)
    holdout = np.sort(np.concatenate([np.flatnonzero(train_y == c)[:30] for c in range(10)]))
    clients = [np.flatnonzero(np.isin(train_y, pair) & ~np.isin(np.arange(1000), holdout)) for pair in ((0, 1), (2, 3))]
    return Partition(clients=tuple(clients), holdout=holdout), train_y, test_y


@pytest.mark.parametrize("nonmembers", ["holdout", "test", "both"])
def test_evaluation_set_is_balanced_disjoint_and_like_with_like(nonmembers: str) -> None:
    partition, train_y, test_y = digits_like()
    ev = build_evaluation_set(partition, train_y, test_y, nonmembers=nonmembers, max_records=5000, seed=0)
    members, others = ev.member == 1, ev.member == 0
    assert ev.num_members == ev.num_nonmembers
    assert set(np.unique(ev.label[others])) <= {0, 1, 2, 3}  # only the classes clients trained on
    member_pool = np.concatenate(partition.clients)
    assert np.all(np.isin(ev.index[members], member_pool)) and np.all(ev.source[members] == "train")
    assert set(ev.client[members]) == {0, 1} and np.all(ev.client[others] == -1)
    train_non = others & (ev.source == "train")
    assert np.all(np.isin(ev.index[train_non], partition.holdout))
    assert not np.intersect1d(ev.index[members], ev.index[train_non]).size
    expected_sources = {"holdout": {"train"}, "test": {"test"}, "both": {"train", "test"}}[nonmembers]
    assert set(ev.source[others]) == expected_sources
    np.testing.assert_array_equal(ev.label[members], train_y[ev.index[members]])
    np.testing.assert_array_equal(ev.label[ev.source == "test"], test_y[ev.index[ev.source == "test"]])
    pairs = list(zip(ev.source, ev.index))
    assert len(set(pairs)) == len(pairs)  # no record twice
    # halves: each side split evenly into attack-train and audit
    for side in (members, others):
        assert abs(int(ev.attack_train[side].sum()) - int((~ev.attack_train[side]).sum())) <= 1
    assert {k: list(v) for k, v in ev.client_classes.items()} == {0: [0, 1], 1: [2, 3]}


def test_evaluation_set_size_cap_and_seed() -> None:
    partition, train_y, test_y = digits_like()
    one = build_evaluation_set(partition, train_y, test_y, max_records=50, seed=3)
    same = build_evaluation_set(partition, train_y, test_y, max_records=50, seed=3)
    other = build_evaluation_set(partition, train_y, test_y, max_records=50, seed=4)
    assert one.num_members == one.num_nonmembers == 50
    for field in ("source", "index", "member", "attack_train"):
        np.testing.assert_array_equal(getattr(one, field), getattr(same, field))
    assert not np.array_equal(one.index, other.index)


def test_evaluation_set_needs_two_records_per_side() -> None:
    partition, train_y, test_y = digits_like()
    lonely = Partition(clients=(partition.clients[0][:1],), holdout=partition.holdout)
    with pytest.raises(AttackError, match="at least 2 members"):
        build_evaluation_set(lonely, train_y, test_y, seed=0)
    with pytest.raises(AttackError, match="non-member source"):
        build_evaluation_set(partition, train_y, test_y, nonmembers="train", seed=0)

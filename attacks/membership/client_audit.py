"""Client-level membership inference (``fedaudit attack --method client``): did a client's data, as a whole, take
part in training?

The unit is a client. Members are the run's clients; each non-member is a held-out twin of one of them: as many
held-out records of each class as the records drawn from that client, so that a member and its twin differ in
membership and not in their mix of classes (a client of two classes against held-out records of all ten would be
told apart by its classes alone). A client is scored by the mean loss of its records on the final model (lower:
member), from up to ``records`` records of each. The clients that choose the threshold of the epsilon lower bound are
half of the pairs; the other half judge it, with the same metrics, intervals and bound as the record-level attacks
(attacks/metrics.py), n being the clients. Against a client-level run the bound is judged against its epsilon per
client; a record-level run's epsilon per record does not bound it (a client is many records), so there it is reported
without the comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from fedaudit.attacks import AttackError
from fedaudit.attacks.metrics import summarize
from fedaudit.data import Partition

DEFAULT_RECORDS = 20  # records drawn from each client (and as many held out for its twin)
LEAST_PAIRS = 4  # clients with a held-out twin, at the least: two choose the threshold, two judge it


def twins(
    partition: Partition, labels: np.ndarray, *, records: int, rng: np.random.Generator
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(client, its drawn records, their held-out twin) for every client whose class mix the held-out pool can still
    match, clients in a random order: the twin has as many held-out records of each class as the drawn ones."""
    pool = {int(c): list(rng.permutation(partition.holdout[labels[partition.holdout] == c])) for c in np.unique(labels)}
    pairs = []
    for client in rng.permutation(len(partition.clients)):
        own = partition.clients[client]
        drawn = rng.choice(own, size=min(records, len(own)), replace=False)
        classes, counts = np.unique(labels[drawn], return_counts=True)
        if all(len(pool.get(int(c), [])) >= n for c, n in zip(classes, counts)):
            twin = np.concatenate([[pool[int(c)].pop() for _ in range(n)] for c, n in zip(classes, counts)])
            pairs.append((int(client), np.sort(drawn), np.sort(twin.astype(np.int64))))
    return pairs


def client_membership(
    partition: Partition,
    labels: np.ndarray,
    loss_of: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int,
    delta: float,
    resamples: int,
    records: int = DEFAULT_RECORDS,
) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame]:
    """The attack's metrics, each client's score and the ROC. ``loss_of`` gives the loss of training records (by
    index) on the attacked model.

    Raises:
        AttackError: fewer than :data:`LEAST_PAIRS` clients have a held-out twin.
    """
    rng = np.random.default_rng(seed)
    pairs = twins(partition, labels, records=records, rng=rng)
    if len(partition.clients) < LEAST_PAIRS:
        raise AttackError(
            f"The run has {len(partition.clients)} clients; the client-level attack needs at least {LEAST_PAIRS} "
            "(each paired with held-out records of its classes): train with more --num-clients."
        )
    if len(pairs) < LEAST_PAIRS:
        raise AttackError(
            f"Only {len(pairs)} of {len(partition.clients)} clients have held-out records of their classes to stand "
            f"for a client that did not take part; the client-level attack needs {LEAST_PAIRS}: train with a larger "
            "--holdout-fraction."
        )
    groups = [drawn for _, drawn, _ in pairs] + [twin for _, _, twin in pairs]
    losses = loss_of(np.concatenate(groups))
    bounds = np.cumsum([0] + [len(g) for g in groups])
    mean_loss = np.array([losses[a:b].mean() for a, b in zip(bounds[:-1], bounds[1:])])
    n = len(pairs)
    member = np.concatenate([np.ones(n, dtype=int), np.zeros(n, dtype=int)])
    choose_pairs = np.zeros(n, dtype=bool)
    choose_pairs[rng.permutation(n)[: n // 2]] = True
    select = np.concatenate([choose_pairs, choose_pairs])
    metrics, curve = summarize(
        member, -mean_loss, report=np.ones(2 * n, dtype=bool), select=select, delta=delta, rng=rng, resamples=resamples
    )
    scores = pd.DataFrame(
        {
            "client": [client for client, _, _ in pairs] * 2,
            "member": member,
            "records": [len(g) for g in groups],
            "mean_loss": mean_loss,
            "score": -mean_loss,
            "bound_role": np.where(select, "choose", "judge"),
        }
    )
    roc = pd.DataFrame({"fpr": curve.fpr, "tpr": curve.tpr, "threshold": curve.thresholds})
    metrics = {
        **metrics,
        "unit": "client",
        "num_members": n,
        "num_nonmembers": n,
        "records_per_client": records,
        "nonmember_clients": "a held-out twin of each member client: as many held-out records of each class",
    }
    return metrics, scores, roc

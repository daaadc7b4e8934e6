"""Membership audits of a federation whose sites keep their records (``--dataset sites``), computed where the data is.

Each site scores its own records: the signals of its members and held-out records on the attacked model are computed by
the site (:func:`fedaudit.instruments.record_signals.compute_signals`), and only the signals and the records' SHA-256
hashes leave it; the hashes must be those membership.npz recorded when the run was trained. The evaluation set is drawn
as for any run (balanced members and non-members, halves for the methods that fit something), with two differences that
the sites' privacy asks for:

- non-members are the sites' held-out records only (each site drew them at random from its own file, so they share
  its members' distribution), drawn site by site: as many of a site's held-out records as of its members, so that
  members and non-members are the same mixture of sites, and a client's per-client results compare its members with
  its own site's held-out records;
- no label leaves a site, so the evaluation set records none (-1).

A run trained here from the sites' files (``--site-data``) is scored the same way, site by site in the same order and
batches, so its results equal those of the same run deployed. A deployed run needs a connection to its sites
(``fedaudit attack --superlink``); the methods that need the records in one place (reference models, reconstruction,
the distance to synthetic images) say so in one sentence.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fedaudit.attacks import AttackError, Draw
from fedaudit.attacks.membership.evaluation import EvaluationSet
from fedaudit.config import RunConfig
from fedaudit.data import Dataset, Partition
from fedaudit.data.sites import locate
from fedaudit.instruments.record_signals import Signals, compute_signals
from fedaudit.seeding import Stream, numpy_rng

TensorDict = dict[str, torch.Tensor]
# Scores records at their sites: (params, positions per site, signals, per_layer=, batch_size=) -> arrays per site.
SiteScorer = Callable[..., dict[int, dict[str, np.ndarray]]]
# Opens a session with a deployed run's sites: (run config with the connection settings, membership, fingerprint).
SiteConnection = Callable[[RunConfig, Mapping[str, np.ndarray], str], AbstractContextManager[SiteScorer]]
NEEDS_RECORDS = "needs the records in one place"


@dataclass(frozen=True, eq=False)
class Sites:
    """Where a sites run's records are: here (``dataset`` holds them, one site after the other) or at the sites."""

    site_records: np.ndarray  # training records per site, in client order
    local: bool

    def positions(self, evaluation: EvaluationSet) -> tuple[np.ndarray, np.ndarray]:
        """Per evaluation record, its site and its position in that site's file."""
        return locate(evaluation.index, self.site_records)


def evaluation_set(
    partition: Partition,
    site_records: np.ndarray,
    *,
    nonmembers: str,
    max_records: int,
    seed: int,
    exclude: np.ndarray | None,
) -> EvaluationSet:
    """The evaluation set of a sites run, drawn site by site: c_k members of client k and c_k of site k's own
    held-out records, the same number of each from every site, so that the members and the non-members are the same
    mixture of sites (a pooled audit then measures membership, not which site a record comes from), with c_k in
    proportion to min(members, held-out records) and the total at most ``max_records`` a side; no label. A client's
    per-client results compare its members with its own site's held-out records (``group``)."""
    if nonmembers == "test":
        raise AttackError(
            "A federation whose sites keep their records is audited on each site's held-out records; its test "
            "records are the sites' own and are not scored: use --nonmembers holdout."
        )
    holdout = partition.holdout if exclude is None else np.setdiff1d(partition.holdout, exclude)
    site_of_holdout, _ = locate(holdout, site_records)
    members = list(partition.clients)
    heldout = [holdout[site_of_holdout == k] for k in range(len(members))]
    room = np.array([min(len(m), len(h)) for m, h in zip(members, heldout)], dtype=np.int64)
    if room.sum() > max_records:
        room = np.floor(room * (max_records / room.sum())).astype(np.int64)
    if room.sum() < 2:
        raise AttackError(
            "An audit of sites needs at least 2 members and 2 held-out records from the same sites, but the sites "
            f"hold {[len(m) for m in members]} members and {[len(h) for h in heldout]} held-out records."
        )
    member_rng = numpy_rng(seed, Stream.ATTACK, Draw.MEMBERS)
    nonmember_rng = numpy_rng(seed, Stream.ATTACK, Draw.NONMEMBERS)
    chosen_members = [np.sort(member_rng.choice(m, c, replace=False)) for m, c in zip(members, room)]
    chosen_heldout = [np.sort(nonmember_rng.choice(h, c, replace=False)) for h, c in zip(heldout, room)]
    per_side = int(room.sum())
    split_rng = numpy_rng(seed, Stream.ATTACK, Draw.HALVES)
    halves = [split_rng.permutation(per_side) < per_side // 2 for _ in range(2)]
    site = np.repeat(np.arange(len(members)), room)
    return EvaluationSet(
        source=np.full(2 * per_side, "train"),
        index=np.concatenate([*chosen_members, *chosen_heldout]).astype(np.int64),
        label=np.full(2 * per_side, -1, dtype=np.int64),
        member=np.repeat(np.array([1, 0], dtype=np.int8), per_side),
        client=np.concatenate([site, np.full(per_side, -1)]).astype(np.int64),
        attack_train=np.concatenate(halves),
        client_classes={k: np.array([k]) for k in range(len(members))},
        group=np.concatenate([site, site]).astype(np.int64),
    )


def site_signals(
    sites: Sites,
    evaluation: EvaluationSet,
    model: nn.Module,
    signals: Sequence[str],
    *,
    dataset: Dataset,
    scorer: SiteScorer | None,
    per_layer: bool,
    batch_size: int,
    device: torch.device,
    round_number: int = 0,
) -> Signals:
    """The signals of the evaluation set's records, each site scoring its own (here from ``dataset`` for a local
    run, else through ``scorer``), in the evaluation set's order."""
    site, position = sites.positions(evaluation)
    order = {int(k): np.flatnonzero(site == k) for k in np.unique(site)}
    if sites.local:
        found = {}
        for k, rows in order.items():
            index = torch.from_numpy(evaluation.index[rows])
            part = compute_signals(
                model,
                dataset.train_x[index],
                dataset.train_y[index],
                signals,
                per_layer=per_layer,
                batch_size=batch_size,
                device=device,
            )
            found[k] = {**part.values, **part.per_layer}
    else:
        if scorer is None:
            raise AttackError("the sites' records are not here and no connection to the sites was given")
        params = {name: p.detach().cpu() for name, p in model.named_parameters()}
        found = scorer(
            params,
            {k: position[rows] for k, rows in order.items()},
            signals,
            per_layer=per_layer,
            batch_size=batch_size,
            round_number=round_number,
        )
    names = list(next(iter(found.values())).keys()) if found else list(signals)
    values = {name: np.zeros(len(evaluation), dtype=np.float64) for name in names}
    for k, rows in order.items():
        for name in names:
            column = np.asarray(found[k][name], dtype=np.float64)
            if column.shape != (len(rows),):
                raise AttackError(
                    f"Client {k}'s site returned {column.shape} values of {name} for {len(rows)} records."
                )
            values[name][rows] = column
    return Signals(
        values={name: values[name] for name in signals},
        per_layer={name: values[name] for name in names if name not in signals},
    )


def refuse(what: str, run: Any) -> AttackError:
    """The one sentence of a method that cannot run where the records stay at the sites."""
    return AttackError(
        f"{run} keeps its records at its sites: {what} {NEEDS_RECORDS}; the loss, confidence and gradient-norm "
        "attacks and the canary audit run at the sites."
    )

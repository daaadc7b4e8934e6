"""The canary audit of ``fedaudit attack --method canary``: score the run's gradient canaries and bound epsilon.

Threat model "the server sees every round": canary i, which belongs to client k, is scored by how far client k's
updates moved against its direction u_i over every round it took part in, score_i = -sum_t <Delta_k^t, u_i> (an
included canary that was sampled adds C u_i to a gradient, which SGD subtracts). The scores of included and
excluded canaries then give two lower bounds (attacks/audit.py): the one-run bound and the Gaussian-DP bound, each
with its threshold chosen on one half of the canaries and judged on the other, each at confidence 1 - 0.05 / 2 so
that the larger holds at 95%. Canaries are records, so the accountant's epsilon is the one they are judged against.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import roc_auc_score

from fedaudit.attacks import AttackError
from fedaudit.attacks.audit import split_audit
from fedaudit.attacks.metrics import CONFIDENCE, roc
from fedaudit.canaries import Canaries, canary_directions
from fedaudit.models import ModelSpec, build_model
from fedaudit.runs import RunDirectory, load_tensors
from fedaudit.seeding import Stream, derive_seed

ESTIMATORS = ("one-run", "gdp")
SIGNAL, METHOD = "update-projection", "canary"
NAME = f"{SIGNAL}-{METHOD}"  # the result directory: attacks/update-projection-canary/
_CHUNK = 256  # canaries whose directions are held in memory at once


def read_canaries(run: RunDirectory) -> Canaries:
    """The run's canaries; a run trained without them is an :class:`AttackError`."""
    arrays = run.read_canaries()
    if arrays is None:
        raise AttackError(
            f"{run.path} was trained without canaries, so --method canary has nothing to audit; train "
            "with --dp --canaries N."
        )
    canaries = Canaries.from_arrays(arrays)
    if canaries.kind != "gradient":
        raise AttackError(f"{run.canaries_path} holds {canaries.kind!r} canaries; this fedaudit audits gradient ones.")
    return canaries


def canary_scores(run: RunDirectory, canaries: Canaries, spec: ModelSpec, rounds: int) -> np.ndarray:
    """score_i = -sum over the rounds 1..``rounds`` that client k_i took part in of <Delta_k^t, u_i>."""
    shapes = {name: p.shape for name, p in build_model(spec).named_parameters()}
    updates: dict[int, list[torch.Tensor]] = {}
    for round_number in range(1, rounds + 1):
        folder = run.transmitted_dir / f"round-{round_number:04d}"
        for file in sorted(folder.glob("client-[0-9][0-9][0-9].safetensors")):
            tensors = load_tensors(file)
            if set(tensors) != set(shapes):
                raise AttackError(f"{file} does not hold a model update of the run's model, so it cannot be scored.")
            flat = torch.cat([tensors[name].reshape(-1).to(torch.float64) for name in shapes])
            updates.setdefault(int(file.stem.split("-")[1]), []).append(flat)
    if not updates:
        raise AttackError(f"{run.path} kept no client updates under transmitted/, which the canary audit reads.")
    scores = np.zeros(canaries.count)
    for client, sent in updates.items():
        total = torch.stack(sent).sum(dim=0)  # the projection is linear: sum the rounds first
        mine = np.flatnonzero(canaries.client == client)
        for start in range(0, len(mine), _CHUNK):
            chunk = mine[start : start + _CHUNK]
            directions = canary_directions(canaries.seed, chunk, shapes)
            flat = torch.cat([directions[name].reshape(len(chunk), -1) for name in shapes], dim=1).to(torch.float64)
            scores[chunk] = -(flat @ total).numpy()
    return scores


def canary_audit(
    run: RunDirectory, *, spec: ModelSpec, rounds: int, delta: float, seed: int, accountant_epsilon: float | None
) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame]:
    """The audit's metrics (for metrics.json), its per-canary scores and its ROC."""
    canaries = read_canaries(run)
    scores = canary_scores(run, canaries, spec, rounds)
    included = canaries.included.astype(int)
    if included.all() or not included.any():
        raise AttackError(f"{run.canaries_path} has canaries on one side only; the audit needs both.")
    level = 1.0 - (1.0 - CONFIDENCE) / len(ESTIMATORS)
    split_seed = derive_seed(seed, Stream.ATTACK, 6)
    bounds = {
        name: split_audit(
            scores[included == 1], scores[included == 0], estimator=name, delta=delta, confidence=level, seed=split_seed
        )
        for name in ESTIMATORS
    }
    epsilon = max(bound.epsilon for bound in bounds.values())
    curve = roc(included, scores)
    metrics = {
        "auc": float(roc_auc_score(included, scores)),
        "num_members": int(included.sum()),
        "num_nonmembers": int((1 - included).sum()),
        "epsilon_lower_bound": epsilon,
        "epsilon_lower_bound_confidence": CONFIDENCE,
        "delta": delta,
        "accountant_epsilon": accountant_epsilon,
        "epsilon_lower_bound_exceeds_accountant": None if accountant_epsilon is None else epsilon > accountant_epsilon,
        "canary_audit": {
            "threat_model": "the server sees every client update of every round",
            "canaries": canaries.count,
            "canary_kind": canaries.kind,
            "estimators": {name: bound.to_dict() for name, bound in bounds.items()},
            "per_estimator_confidence": level,
            "ratio_to_accountant": None if not accountant_epsilon else epsilon / accountant_epsilon,
            "note": "canaries are records: the accountant's epsilon covers them unchanged",
        },
    }
    table = pd.DataFrame(
        {"canary": np.arange(canaries.count), "client": canaries.client, "member": included, "score": scores}
    )
    curve_table = pd.DataFrame({"fpr": curve.fpr, "tpr": curve.tpr, "threshold": curve.thresholds})
    return metrics, table, curve_table

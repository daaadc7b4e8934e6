"""The canary audit of ``fedaudit attack --method canary``: score the run's canaries and bound epsilon.

Three scores, one per kind of canary and view of the run (docs/audit.md):

- gradient canaries of a gradient-sharing run, the server sees every round: canary i, which belongs to client k,
  is scored by how far client k's updates moved against its direction u_i over every round it took part in,
  score_i = -sum_t <Delta_k^t, u_i> (an included canary that was sampled adds C u_i to a gradient, which SGD
  subtracts). Result directory ``update-projection-canary``.
- gradient canaries of a FedLAP-DP run, the server sees every synthetic set: client k's set S_k^t was matched to
  noisy gradients of its data (canaries included), so canary i is scored by how much the gradient that S_k^t
  produces at the round's global model points along u_i, score_i = sum_t <g_k^t / ||g_k^t||, u_i>. Result
  directory ``synthetic-gradient-canary``.
- input canaries, only the final model is seen (black-box): score_i = -loss of the canary record, with the label it
  was trained with, on the final model. Result directory ``loss-canary``.

The scores of included and excluded canaries then give two lower bounds (attacks/audit.py): the one-run bound and
the Gaussian-DP bound, each with its threshold chosen on one half of the canaries and judged on the other, each at
confidence 1 - 0.05 / 2 so that the larger holds at 95%. Canaries are records, so the accountant's epsilon is the
one they are judged against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.func import functional_call

from fedaudit.attacks import AttackError, Draw
from fedaudit.attacks.audit import bound_by_guesses, split_audit
from fedaudit.attacks.metrics import CONFIDENCE, roc
from fedaudit.canaries import Canaries, canary_directions
from fedaudit.data import Dataset
from fedaudit.models import ModelSpec, build_model, initial_params
from fedaudit.privacy.primitive import per_sample_gradients
from fedaudit.runs import RunDirectory, load_tensors
from fedaudit.seeding import Stream, derive_seed

ESTIMATORS = ("one-run", "gdp")
METHOD = "canary"
_CHUNK = 256  # canaries whose directions are held in memory at once


@dataclass(frozen=True)
class View:
    """What a canary audit scores: its signal (the first part of its result directory's name) and threat model."""

    signal: str
    threat_model: str

    @property
    def name(self) -> str:
        return f"{self.signal}-{METHOD}"


UPDATES = View("update-projection", "the server sees every client update of every round")
SYNTHETIC = View("synthetic-gradient", "the server sees every synthetic set of every round")
FINAL_LOSS = View("loss", "only the final model is seen (black-box loss of each canary)")
VIEWS = (UPDATES, SYNTHETIC, FINAL_LOSS)


def canary_views(kind: str, algorithm: str) -> tuple[View, ...]:
    """The views a run's canaries are audited in: what crossed the wire, and for input canaries the final model."""
    wire = SYNTHETIC if algorithm == "fedlap" else UPDATES
    return (wire, FINAL_LOSS) if kind == "input" else (wire,)


def read_canaries(run: RunDirectory) -> Canaries:
    """The run's canaries; a run trained without them is an :class:`AttackError`."""
    arrays = run.read_canaries()
    if arrays is None:
        raise AttackError(
            f"{run.path} was trained without canaries, so --method canary has nothing to audit; train "
            "with --dp --canaries N."
        )
    canaries = Canaries.from_arrays(arrays)
    if canaries.kind not in ("gradient", "input") or (canaries.kind == "input" and canaries.record is None):
        raise AttackError(f"{run.canaries_path} holds {canaries.kind!r} canaries, which this fedaudit cannot audit.")
    return canaries


def _shapes(spec: ModelSpec) -> dict[str, torch.Size]:
    return {name: p.shape for name, p in build_model(spec).named_parameters()}


def _round_payloads(run: RunDirectory, rounds: int) -> dict[int, dict[int, dict[str, torch.Tensor]]]:
    """What every client sent in rounds 1..``rounds``: round -> client -> tensors."""
    sent: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for round_number in range(1, rounds + 1):
        folder = run.transmitted_dir / f"round-{round_number:04d}"
        for file in sorted(folder.glob("client-[0-9][0-9][0-9].safetensors")):
            sent.setdefault(round_number, {})[int(file.stem.split("-")[1])] = load_tensors(file)
    if not sent:
        raise AttackError(f"{run.path} kept nothing under transmitted/, which this canary audit reads.")
    return sent


def _round_start(run: RunDirectory, spec: ModelSpec, round_number: int, run_seed: int) -> dict[str, torch.Tensor]:
    """The global model round ``round_number`` started from (round 1's is rebuilt from the run's seed)."""
    if round_number == 1:
        return initial_params(spec, run_seed)
    return run.load_checkpoint(round_number - 1)[0]


def _sent_vector(
    run: RunDirectory, model: nn.Module, params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], where: str
) -> torch.Tensor:
    """What a client sent, as the direction the canaries pushed it: -Delta for a model update, g / ||g|| for a
    synthetic set (g its cross-entropy gradient at the round's global model)."""
    shapes = {name: p.shape for name, p in params.items()}
    if "images" in tensors and "labels" in tensors:
        leaves = {name: p.detach().to(torch.float32).requires_grad_(True) for name, p in params.items()}
        loss = F.cross_entropy(functional_call(model, leaves, (tensors["images"],)), tensors["labels"].long())
        flat = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(leaves.values()))]).to(torch.float64)
        return flat / flat.norm().clamp_min(1e-30)
    if not set(shapes) <= set(tensors):  # a model update (SCAFFOLD's also carries a control delta)
        raise AttackError(f"{run.path} {where} holds neither a model update nor a synthetic set of the run's model.")
    return -torch.cat([tensors[name].reshape(-1).to(torch.float64) for name in shapes])


def _gradient_directions(canaries: Canaries, chunk: np.ndarray, shapes: dict[str, torch.Size]) -> torch.Tensor:
    directions = canary_directions(canaries.seed, chunk, shapes)
    return torch.cat([directions[name].reshape(len(chunk), -1) for name in shapes], dim=1).to(torch.float64)


def _input_directions(
    canaries: Canaries, chunk: np.ndarray, dataset: Dataset, model: nn.Module, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    """g_i / ||g_i||, g_i the gradient of input canary i's loss (with its replaced label) at ``params``: the direction
    its clipped contribution to a DP query takes."""
    x = dataset.train_x[torch.from_numpy(canaries.record[chunk])]
    y = torch.from_numpy(canaries.label[chunk])
    grads = per_sample_gradients(model, x, y, params={name: p.detach().to(torch.float32) for name, p in params.items()})
    flat = torch.cat([grads[name].reshape(len(chunk), -1) for name in params], dim=1).to(torch.float64)
    return flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-30)


def wire_scores(
    run: RunDirectory, canaries: Canaries, dataset: Dataset, spec: ModelSpec, rounds: int, run_seed: int
) -> np.ndarray:
    """score_i = sum over the rounds 1..``rounds`` that client k_i took part in of <v_k^t, d_i^t>: v what the client
    sent (see :func:`_sent_vector`), d_i^t canary i's direction (u_i, or its normalised loss gradient at the
    round's global model)."""
    shapes = _shapes(spec)
    model = build_model(spec)
    scores = np.zeros(canaries.count)
    fixed = canaries.kind == "gradient"
    totals: dict[int, torch.Tensor] = {}
    for round_number, clients in _round_payloads(run, rounds).items():
        params = _round_start(run, spec, round_number, run_seed)
        params = {name: params[name] for name in shapes}
        for client, tensors in clients.items():
            sent = _sent_vector(run, model, params, tensors, f"round {round_number}, client {client}")
            if fixed:  # the projection is linear: sum the rounds first
                totals[client] = totals.get(client, 0) + sent
                continue
            mine = np.flatnonzero(canaries.client == client)
            for start in range(0, len(mine), _CHUNK):
                chunk = mine[start : start + _CHUNK]
                scores[chunk] += (_input_directions(canaries, chunk, dataset, model, params) @ sent).numpy()
    for client, total in totals.items():
        mine = np.flatnonzero(canaries.client == client)
        for start in range(0, len(mine), _CHUNK):
            chunk = mine[start : start + _CHUNK]
            scores[chunk] = (_gradient_directions(canaries, chunk, shapes) @ total).numpy()
    return scores


def loss_scores(run: RunDirectory, canaries: Canaries, dataset: Dataset, batch_size: int = 1024) -> np.ndarray:
    """score_i = -cross-entropy of canary record i, with the label it was trained with, on the final model."""
    model = run.load_model(None)
    x = dataset.train_x[torch.from_numpy(canaries.record)]
    y = torch.from_numpy(canaries.label)
    losses = []
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            out = model(x[start : start + batch_size])
            losses.append(F.cross_entropy(out, y[start : start + batch_size], reduction="none").to(torch.float64))
    return -torch.cat(losses).numpy()


def canary_audit(
    run: RunDirectory,
    *,
    algorithm: str,
    dataset: Dataset,
    rounds: int,
    delta: float,
    run_seed: int,
    seed: int,
    accountant_epsilon: float | None,
) -> list[tuple[View, dict[str, Any], pd.DataFrame, pd.DataFrame]]:
    """Each view's audit: the view, its metrics (for metrics.json), its per-canary scores and its ROC.

    Every estimator of every view is judged at confidence 1 - 0.05 / (estimators x views), so that the largest of
    all the bounds of a run holds at 95%.
    """
    canaries = read_canaries(run)
    spec = run.model_spec()
    included = canaries.included.astype(int)
    if included.all() or not included.any():
        raise AttackError(f"{run.canaries_path} has canaries on one side only; the audit needs both.")
    views = canary_views(canaries.kind, algorithm)
    level = 1.0 - (1.0 - CONFIDENCE) / (len(ESTIMATORS) * len(views))
    split_seed = derive_seed(seed, Stream.ATTACK, Draw.CANARY_SPLIT)
    audits = []
    for view in views:
        if view is FINAL_LOSS:
            scores = loss_scores(run, canaries, dataset)
        else:
            scores = wire_scores(run, canaries, dataset, spec, rounds, run_seed)
        bounds = {
            name: split_audit(
                scores[included == 1],
                scores[included == 0],
                estimator=name,
                delta=delta,
                confidence=level,
                seed=split_seed,
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
            "epsilon_lower_bound_exceeds_accountant": None
            if accountant_epsilon is None
            else epsilon > accountant_epsilon,
            "canary_audit": {
                "threat_model": view.threat_model,
                "canaries": canaries.count,
                "canary_kind": canaries.kind,
                "estimators": {name: bound.to_dict() for name, bound in bounds.items()},
                "per_estimator_confidence": level,
                "views": [v.name for v in views],
                "bound_by_guesses": bound_by_guesses(
                    scores[included == 1], scores[included == 0], delta=delta, confidence=level
                ),
                "ratio_to_accountant": None if not accountant_epsilon else epsilon / accountant_epsilon,
                "note": "canaries are records: the accountant's epsilon covers them unchanged",
            },
        }
        columns: dict[str, Any] = {"canary": np.arange(canaries.count), "client": canaries.client}
        if canaries.record is not None:
            columns.update(record=canaries.record, label=canaries.label)
        table = pd.DataFrame({**columns, "member": included, "score": scores})
        curve_table = pd.DataFrame({"fpr": curve.fpr, "tpr": curve.tpr, "threshold": curve.thresholds})
        audits.append((view, metrics, table, curve_table))
    return audits

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

The scores of included and excluded canaries then give two lower bounds (attacks/canary/estimators.py): the one-run
bound and the Gaussian-DP bound, each with its threshold chosen on one half of the canaries and judged on the other,
each at confidence 1 - 0.05 / 2 so that the larger holds at 95%. Canaries are records, so the accountant's epsilon is
the one they are judged against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedaudit.attacks import AttackError, Draw
from fedaudit.attacks.canary.estimators import bound_by_guesses, gaussian_estimate, split_audit
from fedaudit.attacks.metrics import CONFIDENCE, Bootstrap, auc_score, bootstrap, roc
from fedaudit.attacks.registry import CANARY_METHOD
from fedaudit.data import Dataset
from fedaudit.instruments.canaries import LAYOUTS, Canaries, canary_directions, canary_groups, group_of
from fedaudit.models import ModelSpec, build_model, initial_params
from fedaudit.privacy.primitive import per_sample_gradients
from fedaudit.registry import ALGORITHMS, WIRE_SYNTHETIC
from fedaudit.rundir import RunDirectory, load_tensors
from fedaudit.seeding import Stream, derive_seed

ESTIMATORS = ("one-run", "gdp")
METHOD = CANARY_METHOD  # the registry's name of this attack
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
QUERY_SUM = View(
    "query-sum",
    "the auditor sees every noisy DP query (white-box, all iterates): each canary's projection on the released "
    "sums of its client's queries (a gradient canary's direction, an input canary's normalised gradient at the "
    "query's point), summed",
)
QUERY_LLR = View(
    "query-llr",
    "the auditor sees every noisy DP query (white-box, all iterates): the likelihood ratio of the "
    "Poisson-subsampled Gaussian of each canary's projections, over its client's queries",
)
VIEWS = (UPDATES, SYNTHETIC, FINAL_LOSS, QUERY_SUM, QUERY_LLR)
QUERY_VIEWS = (QUERY_SUM, QUERY_LLR)


def canary_views(kind: str, algorithm: str, queries: bool = False) -> tuple[View, ...]:
    """The views a run's canaries are audited in: what crossed the wire, for input canaries the final model, and
    for a run with a query log (``queries``) every noisy query."""
    entry = ALGORITHMS.get(algorithm)
    wire = SYNTHETIC if entry is not None and entry.wire == WIRE_SYNTHETIC else UPDATES
    views = (wire, FINAL_LOSS) if kind == "input" else (wire,)
    return views + QUERY_VIEWS if queries else views


def run_views(run: RunDirectory) -> tuple[View, ...]:
    """:func:`canary_views` of a canary run as it stands on disk."""
    return canary_views(
        read_canaries(run).kind, run.read_run_config().federated.algorithm, run.queries.path(1).is_file()
    )


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
    if canaries.layout not in LAYOUTS:
        raise AttackError(
            f"{run.canaries_path} lays its canaries out as {canaries.layout!r}, which this fedaudit cannot read."
        )
    return canaries


def canary_parts(canaries: Canaries, spec: ModelSpec) -> tuple[list[str], np.ndarray] | None:
    """The parts of the model a "parts" run's gradient canaries lie in, and each canary's part (its name); None for
    canaries that all span the model."""
    if canaries.kind != "gradient" or canaries.layout != "parts":
        return None
    groups = canary_groups(list(_shapes(spec)))
    return [g.name for g in groups], np.array([group_of(i, groups).name for i in range(canaries.count)])


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
    return run.checkpoints.params(round_number - 1)


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
    directions = canary_directions(canaries.seed, chunk, shapes, layout=canaries.layout)
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
    run: RunDirectory,
    canaries: Canaries,
    dataset: Dataset,
    spec: ModelSpec,
    rounds: int,
    run_seed: int,
    *,
    updates_only: bool = False,
) -> np.ndarray:
    """score_i = sum over the rounds 1..``rounds`` that client k_i took part in of <v_k^t, d_i^t>: v what the client
    sent (see :func:`_sent_vector`), d_i^t canary i's direction (u_i, or its normalised loss gradient at the
    round's global model). With ``updates_only``, what is not a model update is left out (Fedssyn's generated
    records: they were not made to match the model's gradients)."""
    shapes = _shapes(spec)
    model = build_model(spec)
    scores = np.zeros(canaries.count)
    fixed = canaries.kind == "gradient"
    totals: dict[int, torch.Tensor] = {}
    for round_number, clients in _round_payloads(run, rounds).items():
        params = _round_start(run, spec, round_number, run_seed)
        params = {name: params[name] for name in shapes}
        for client, tensors in clients.items():
            if updates_only and "images" in tensors:
                continue
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


def query_scores(run: RunDirectory, canaries: Canaries, rounds: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The query view's two scores of every canary and which canaries were informative (their client answered at
    least one query): the sum of its projections over its client's queries, divided by sigma sqrt(T_i) so that
    canaries of clients with different numbers of queries T_i share one scale (an excluded canary's is about
    N(0, 1), an included one's mean is about q sqrt(T_i) / sigma), and the summed log-likelihood ratio. Queries
    logged with their metadata only (``projected`` 0: Fedssyn's class counts) add nothing to either."""
    total, llr = np.zeros(canaries.count), np.zeros(canaries.count)
    queries, variance = np.zeros(canaries.count), np.zeros(canaries.count)
    for round_number in range(1, rounds + 1):
        if not run.queries.path(round_number).is_file():
            raise AttackError(
                f"{run.path} has no query log for round {round_number} ({run.queries.path(round_number)}), so its "
                "query view cannot be audited; it was changed after training."
            )
        for client, log in run.queries.load(round_number).items():
            ids = log["canary_ids"].numpy().astype(np.int64)
            if len(ids) and (ids.min() < 0 or ids.max() >= canaries.count or (canaries.client[ids] != client).any()):
                raise AttackError(
                    f"{run.queries.path(round_number)} logs canaries for client {client} that are not its own."
                )
            projected = log["projected"].numpy() > 0 if "projected" in log else np.ones(len(log["rate"]), dtype=bool)
            total[ids] += log["sum"].numpy()
            llr[ids] += log["llr"].numpy()
            queries[ids] += int(projected.sum())
            variance[ids] += float((log["noise_multiplier"].numpy()[projected] ** 2).sum())
    informative = queries > 0
    scale = np.sqrt(np.where(informative, variance, 1.0))
    return np.where(informative, total / np.where(scale > 0, scale, 1.0), 0.0), llr, informative


def _senders(run: RunDirectory, rounds: int) -> set[int]:
    """The clients that sent something in rounds 1..``rounds`` (their canaries are the informative ones)."""
    return {client for clients in _round_payloads(run, rounds).values() for client in clients}


def _auc_interval(inside: np.ndarray, outside: np.ndarray, seed: int) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the canaries' AUC (included and excluded resampled separately)."""
    member = np.r_[np.ones(len(inside), dtype=int), np.zeros(len(outside), dtype=int)]
    resampled = bootstrap(member, np.r_[inside, outside], rng=np.random.default_rng(seed))
    return Bootstrap.interval(resampled.auc)


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


def _part_bounds(
    parts: tuple[list[str], np.ndarray],
    scores: np.ndarray,
    informative: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float,
    seed: int,
) -> dict[str, dict[str, Any]]:
    """Each part's bounds from its own canaries (parts with fewer than two informative canaries on a side have
    none, and keep their share of the confidence)."""
    names, labels = parts
    found: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = labels == name
        inside = scores[mine & informative & (included == 1)]
        outside = scores[mine & informative & (included == 0)]
        if len(inside) < 2 or len(outside) < 2:
            continue
        bounds = {
            estimator: split_audit(inside, outside, estimator=estimator, delta=delta, confidence=confidence, seed=seed)
            for estimator in ESTIMATORS
        }
        found[name] = {
            "canaries": int(mine.sum()),
            "informative": int((mine & informative).sum()),
            "epsilon_lower_bound": max(bound.epsilon for bound in bounds.values()),
            "estimators": {estimator: bound.to_dict() for estimator, bound in bounds.items()},
        }
    return found


def _confidences(views: int, parts: int | None) -> tuple[float, float | None]:
    """The confidence of each estimator's bound over all canaries, and of each part's (None without parts): 0.05
    split over estimators and views, and with parts half of it over the parts' bounds."""
    shares = 1 if parts is None else 2
    level = 1.0 - (1.0 - CONFIDENCE) / (shares * len(ESTIMATORS) * views)
    part_level = None if parts is None else 1.0 - (1.0 - CONFIDENCE) / (2 * len(ESTIMATORS) * views * parts)
    return level, part_level


def _canary_table(
    canaries: Canaries, included: np.ndarray, informative: np.ndarray, scores: np.ndarray
) -> pd.DataFrame:
    """scores.csv of a view: every canary, its client (and record), whether it was included and counts, its score."""
    columns: dict[str, Any] = {"canary": np.arange(canaries.count), "client": canaries.client}
    if canaries.record is not None:
        columns.update(record=canaries.record, label=canaries.label)
    return pd.DataFrame({**columns, "member": included, "informative": informative, "score": scores})


CANARY_NOTE = (
    "canaries are records: the accountant's epsilon covers them unchanged; canaries of clients that never took part "
    "carry no evidence and are left out"
)


def _wire_view(
    run: RunDirectory, canaries: Canaries, dataset: Dataset, spec: ModelSpec, rounds: int, run_seed: int, algorithm: str
) -> tuple[np.ndarray, np.ndarray]:
    """The wire view's scores, and which canaries count (those of clients that sent something)."""
    entry = ALGORITHMS.get(algorithm)
    mixed = entry is not None and entry.generation_rounds > 0  # synthetic records first: the updates are the wire
    scores = wire_scores(run, canaries, dataset, spec, rounds, run_seed, updates_only=mixed)
    return scores, np.isin(canaries.client, sorted(_senders(run, rounds)))


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
    all the bounds of a run holds at 95%. Canaries in parts of the model (:func:`canary_parts`) share the 0.05: half
    for the bounds over all canaries, half split evenly over the parts' bounds, whose largest joins each view's.
    """
    canaries = read_canaries(run)
    spec = run.model_spec()
    included = canaries.included.astype(int)
    if included.all() or not included.any():
        side = "inserted" if included.all() else "left out"
        raise AttackError(
            f"{run.canaries_path}: every one of its {len(included)} canaries was {side} (each is, with probability "
            "1/2), and the audit compares the inserted with the left out: train with more --canaries (hundreds)."
        )
    views = run_views(run)
    parts = canary_parts(canaries, spec)
    level, part_level = _confidences(len(views), None if parts is None else len(parts[0]))
    judging = _Judging(
        canaries,
        included,
        tuple(views),
        parts,
        level,
        part_level,
        delta,
        derive_seed(seed, Stream.ATTACK, Draw.CANARY_SPLIT),
        accountant_epsilon,
    )
    queried = query_scores(run, canaries, rounds) if any(v in QUERY_VIEWS for v in views) else None
    audits = []
    for view in views:
        if view in QUERY_VIEWS and queried is not None:
            scores, informative = queried[0] if view is QUERY_SUM else queried[1], queried[2]
        elif view is FINAL_LOSS:
            scores, informative = loss_scores(run, canaries, dataset), np.ones(canaries.count, dtype=bool)
        else:
            scores, informative = _wire_view(run, canaries, dataset, spec, rounds, run_seed, algorithm)
        inside, outside = scores[informative & (included == 1)], scores[informative & (included == 0)]
        if not len(inside) or not len(outside):
            raise AttackError(
                f"{run.path}: no client that holds both included and excluded canaries took part, so the "
                f"{view.name} view has nothing to compare."
            )
        if min(len(inside), len(outside)) < 2:  # the split audit chooses on some of each side and judges on others
            raise AttackError(
                f"{run.path}: the {view.name} view has {len(inside)} included and {len(outside)} excluded canaries "
                "(each is included with probability 1/2); its bounds need at least two of each: train with more "
                "--canaries."
            )
        curve = roc(included[informative], scores[informative])
        curve_table = pd.DataFrame({"fpr": curve.fpr, "tpr": curve.tpr, "threshold": curve.thresholds})
        metrics = _judge(view, scores, informative, judging)
        audits.append((view, metrics, _canary_table(canaries, included, informative, scores), curve_table))
    return audits


@dataclass(frozen=True)
class _Judging:
    """What every view of one run's canary audit is judged with."""

    canaries: Canaries
    included: np.ndarray
    views: tuple[View, ...]
    parts: tuple[list[str], np.ndarray] | None  # canary_parts(): each canary's part of the model
    level: float
    part_level: float | None
    delta: float
    split_seed: int
    accountant_epsilon: float | None


def _judge(view: View, scores: np.ndarray, informative: np.ndarray, judging: _Judging) -> dict[str, Any]:
    """A view's metrics.json: its AUC, every estimator's bound (and each part's), the largest of them against the
    accountant's epsilon, and the Gaussian estimate."""
    j, included = judging, judging.included
    inside, outside = scores[informative & (included == 1)], scores[informative & (included == 0)]
    bounds = {
        name: split_audit(inside, outside, estimator=name, delta=j.delta, confidence=j.level, seed=j.split_seed)
        for name in ESTIMATORS
    }
    by_part = {}
    if j.parts is not None and j.part_level is not None:
        by_part = _part_bounds(
            j.parts, scores, informative, included, delta=j.delta, confidence=j.part_level, seed=j.split_seed
        )
    epsilon = max([b.epsilon for b in bounds.values()] + [part["epsilon_lower_bound"] for part in by_part.values()])
    estimate = None
    if len(inside) > 1 and len(outside) > 1:
        estimate = gaussian_estimate(inside, outside, delta=j.delta, seed=j.split_seed)
    accountant = j.accountant_epsilon
    return {
        "auc": auc_score(included[informative], scores[informative]),
        "auc_ci95": list(_auc_interval(inside, outside, j.split_seed)),
        "num_members": int(len(inside)),
        "num_nonmembers": int(len(outside)),
        "epsilon_lower_bound": epsilon,
        "epsilon_lower_bound_confidence": CONFIDENCE,
        "delta": j.delta,
        "accountant_epsilon": accountant,
        "epsilon_lower_bound_exceeds_accountant": None if accountant is None else epsilon > accountant,
        "canary_audit": {
            "threat_model": view.threat_model,
            "canaries": j.canaries.count,
            "informative_canaries": int(informative.sum()),
            "canary_kind": j.canaries.kind,
            "estimators": {name: bound.to_dict() for name, bound in bounds.items()},
            "per_estimator_confidence": j.level,
            "parts": by_part,
            "per_part_confidence": j.part_level,
            "views": [v.name for v in j.views],
            "bound_by_guesses": bound_by_guesses(inside, outside, delta=j.delta, confidence=j.level),
            "ratio_to_accountant": None if not accountant else epsilon / accountant,
            "estimate": None if estimate is None else estimate.to_dict(),
            "note": CANARY_NOTE,
        },
    }

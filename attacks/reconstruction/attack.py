"""Reconstruction audits (``fedaudit attack --method reconstruction``): can the server rebuild a client's records from
what it received?

Two views of what crossed the wire (``transmitted/``, kept by ``train --save-transmitted``):

- **A model update** (FedAvg, FedProx, FedSGD, SCAFFOLD, with or without DP; Fedssyn after its first round): gradient
  inversion as Inverting Gradients does it (Geiping et al. 2020). The attacker is the server: it knows the round's
  global model, the model, the client's number of records and the recipe of its local training (batch size, local
  steps, learning rate and its schedule, momentum, FedProx's mu, SCAFFOLD's control variates, the DP clipping norm),
  and Fedssyn's synthetic share that it dealt the client. It recovers the labels from the update of the last layer's
  bias (exactly for one record, as iDLG does; their counts for several, as Geng et al. 2021), then optimises dummy
  records so that the update they would produce points where the received one does: 1 - cosine similarity, plus a
  total-variation prior, with Adam and a box constraint on the pixels, from several random starts. Local training
  with several steps is simulated step by step, as Dimitrov et al. (2022) do for FedAvg: one copy of the records per
  epoch (their order in an epoch is unknown), pulled together by their epoch order-invariant prior. A DP step is
  simulated by its expectation, the mean of every record's clipped gradient (the noise is unknown).
- **A synthetic set** (FedLAP, FedLAP-DP, FedGM, FedDM, Fedssyn's first round): the images themselves; each is
  compared with the nearest real record of its client.

Each reconstructed image is judged against a real record of the client (one record per reconstruction, the assignment
of least total error, since the order of a batch is unknown) by PSNR and SSIM in pixel space (:mod:`image_quality`),
and a record counts as recovered at a stated PSNR. The same attack on a null that carries no record (a random update
of the received update's norm; real held-out records in place of the synthetic images) says what the numbers are
worth: an attack no better than its null has recovered nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from scipy import stats
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.func import functional_call, grad, vmap

from fedaudit.attacks import AttackError, Draw
from fedaudit.attacks.metrics import rate_interval
from fedaudit.attacks.options import (
    ReconstructionOptions,
)
from fedaudit.attacks.options import (
    parse_reconstruction_target as parse_target,
)
from fedaudit.attacks.reconstruction.image_quality import (
    MIN_SSIM_SIDE,
    assign,
    nearest,
    pair_quality,
    pixel_range,
    quality_summary,
    ssim_window,
    to_pixels,
)
from fedaudit.attacks.registry import RECONSTRUCTION_METHOD
from fedaudit.config import RunConfig
from fedaudit.data import Dataset, Partition
from fedaudit.models import ModelSpec, build_model, initial_params
from fedaudit.registry import ALGORITHMS, WIRE_SYNTHETIC, AlgorithmEntry
from fedaudit.rundir import Manifest, RunDirectory, csv_bytes, load_tensors, tensors_bytes
from fedaudit.seeding import Stream, derive_seed

METHOD = RECONSTRUCTION_METHOD  # the registry's name of this attack
UPDATE_SIGNAL, SYNTHETIC_SIGNAL = "update-inversion", "synthetic-nearest"
MATCH_EVERY = 25  # iterations between re-matchings of the epochs' copies
LABEL_PROBES = 64  # random inputs on which the label counts' mean softmax is estimated
MAX_RECORDS = 1024  # records one update may average for the attack to try it
SHOWN = 16  # reconstructions (best first) kept in images.safetensors for the report's grid
_COPY_CAP = 64  # copies of the records (epochs) simulated at most
NULL_KIND = {UPDATE_SIGNAL: "random-update", SYNTHETIC_SIGNAL: "held-out"}

NULL_LEVEL = 0.025  # the one-sided level at which an attack is called better than its null
PSNR_CEILING = 100.0  # dB: an image equal to its record to float32 rounding


@dataclass(frozen=True)
class ReconstructionTarget:
    """One update (or synthetic set) that crossed the wire: what client ``client`` sent in round ``round``."""

    round: int
    client: int

    @property
    def name(self) -> str:
        return f"{METHOD}-round-{self.round}-client-{self.client}"


# ----------------------------------------------------------------------------------------------------------------
# The server's knowledge of a client's local training, and its simulation


@dataclass(frozen=True)
class LocalTraining:
    """A client's local training in one round as the server knows it, which the attack simulates.

    Non-DP steps take ``batch_size`` records each, epoch after epoch over the client's records in an order the
    server does not know (``full_batch``: FedSGD's one step on every record). A DP step (``max_grad_norm`` set) is
    simulated by its expectation over the Poisson sample, the mean over every record of its clipped gradient.
    """

    steps: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    mu: float = 0.0
    correction: dict[str, torch.Tensor] | None = None  # SCAFFOLD's c - c_k, added to every step's gradient
    full_batch: bool = False
    max_grad_norm: float | None = None

    def step_weights(self) -> np.ndarray:
        """How much each step's gradient moves the final weights with SGD's momentum: lr * sum of beta^(u - t)."""
        weights = np.empty(self.steps)
        carried = 0.0
        for t in reversed(range(self.steps)):
            carried = 1.0 + self.momentum * carried
            weights[t] = self.lr * carried
        return weights

    def copies(self, records: int) -> int:
        """Copies of the records the simulation holds: one per epoch touched when an epoch takes several batches
        (the records' order differs between epochs), else one."""
        if self.full_batch or self.max_grad_norm is not None:
            return 1
        per_epoch = math.ceil(records / self.batch_size)
        return 1 if per_epoch <= 1 else min(math.ceil(self.steps / per_epoch), _COPY_CAP)

    def plan(self, records: int, generator: torch.Generator) -> list[tuple[int, torch.Tensor]]:
        """(copy, rows) of every step: full-batch and DP steps take every row of copy 0; epochs of non-DP steps take
        consecutive batches of a random order of the rows (the copies make the order of unknown records
        irrelevant; the order spreads known records over the batches, as shuffling does)."""
        every = torch.arange(records)
        if self.full_batch or self.max_grad_norm is not None:
            return [(0, every)] * self.steps
        per_epoch = math.ceil(records / self.batch_size)
        copies = self.copies(records)
        orders = [torch.randperm(records, generator=generator) for _ in range(copies)]
        plan = []
        for t in range(self.steps):
            epoch, j = divmod(t, per_epoch)
            copy = min(epoch, copies - 1)
            plan.append((copy, orders[copy][j * self.batch_size : (j + 1) * self.batch_size]))
        return plan


def simulate_update(
    model: nn.Module,
    start: dict[str, torch.Tensor],
    copies: Sequence[torch.Tensor],
    labels: torch.Tensor,
    training: LocalTraining,
    plan: Sequence[tuple[int, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The model delta local training would send from ``start`` on these records (differentiable in the records):
    SGD with momentum, FedProx's proximal gradient and SCAFFOLD's correction added to each step's gradient, as the
    clients do; a DP step uses the mean clipped gradient of every record."""
    params = {name: p.detach().requires_grad_(True) for name, p in start.items()}
    names = list(params)
    buffer: dict[str, torch.Tensor] | None = None
    for copy, rows in plan:
        x, y = copies[copy][rows], labels[rows]
        if training.max_grad_norm is None:
            loss = F.cross_entropy(functional_call(model, params, (x,)), y)
            grads = dict(zip(names, torch.autograd.grad(loss, [params[n] for n in names], create_graph=True)))
        else:
            grads = _mean_clipped_gradient(model, params, x, y, training.max_grad_norm)
        for name in names:
            if training.mu:
                grads[name] = grads[name] + training.mu * (params[name] - start[name])
            if training.correction is not None:
                grads[name] = grads[name] + training.correction[name]
        if training.momentum and buffer is not None:
            buffer = {name: training.momentum * buffer[name] + grads[name] for name in names}
        else:
            buffer = grads
        params = {name: params[name] - training.lr * buffer[name] for name in names}
    return {name: params[name] - start[name] for name in names}


def _mean_clipped_gradient(
    model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, max_grad_norm: float
) -> dict[str, torch.Tensor]:
    """The mean of the records' gradients, each clipped to ``max_grad_norm`` as the DP primitive clips it."""

    def record_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_record = vmap(grad(record_loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_record.values()]).sum(0).sqrt()
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return {name: (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0) / len(y) for name, g in per_record.items()}


# ----------------------------------------------------------------------------------------------------------------
# Labels


def bias_name(model: nn.Module, num_classes: int) -> str | None:
    """The name of the last layer's bias when the model ends in a linear layer with a bias over the classes (what
    analytic label recovery reads), else None."""
    last = None
    for prefix, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            last = (prefix, module)
    if last is None:
        return None
    prefix, module = last
    if not isinstance(module, nn.Linear) or module.bias is None or module.out_features != num_classes:
        return None
    names = [name for name, _ in model.named_parameters()]
    name = f"{prefix}.bias" if prefix else "bias"
    return name if names[-2:] in ([f"{prefix}.weight", name], [name, f"{prefix}.weight"]) else None


def recover_labels(
    model: nn.Module,
    start: dict[str, torch.Tensor],
    delta: dict[str, torch.Tensor],
    training: LocalTraining,
    *,
    unknown: int,
    known_labels: torch.Tensor,
    num_classes: int,
    box: tuple[torch.Tensor, torch.Tensor],
    shape: tuple[int, ...],
    generator: torch.Generator,
) -> torch.Tensor:
    """The labels of the ``unknown`` records, sorted, from the update of the last layer's bias.

    Cross-entropy's bias gradient is p - onehot(y): for one record its only negative entry is the label (iDLG). For
    several, the update's bias is about -(sum of step weights) x mean over records of (p - onehot), so the count of
    class c is n p_c + n b_c / W (Geng et al. 2021), with the mean softmax p estimated on random inputs at the
    round's model; the counts are rounded by largest remainder. Known records (Fedssyn's share) are subtracted.
    """
    name = bias_name(model, num_classes)
    weights = training.step_weights()
    total = float(weights.sum())
    shift = delta[name].detach().double().cpu()
    if training.correction is not None:
        shift = shift + total * training.correction[name].detach().double().cpu()
    signal = -shift / total  # about the mean bias gradient over the records
    if unknown == 1 and not len(known_labels):
        return torch.argmin(signal).view(1)
    records = unknown + len(known_labels)
    low, high = box
    probes = low.view(1, -1, 1, 1) + (high - low).view(1, -1, 1, 1) * torch.rand(
        (LABEL_PROBES, *shape), generator=generator
    )
    with torch.no_grad():
        mean_softmax = F.softmax(functional_call(model, start, (probes,)), dim=1).mean(0).double().cpu()
    counts = records * (mean_softmax - signal)
    counts -= torch.bincount(known_labels.cpu(), minlength=num_classes).double()
    return torch.repeat_interleave(torch.arange(num_classes), _largest_remainder(counts.clamp(min=0.0), unknown))


def _largest_remainder(estimates: torch.Tensor, total: int) -> torch.Tensor:
    """Non-negative integers summing to ``total`` in proportion to ``estimates`` (Hamilton's method)."""
    if float(estimates.sum()) <= 0:
        estimates = torch.ones_like(estimates)
    quotas = estimates / estimates.sum() * total
    counts = quotas.floor().long()
    remainders = (quotas - counts).numpy()
    for index in np.argsort(-remainders, kind="stable")[: total - int(counts.sum())]:
        counts[index] += 1
    return counts


# ----------------------------------------------------------------------------------------------------------------
# Inverting Gradients


@dataclass
class Inversion:
    """The reconstructed records and how well their simulated update matches the received one."""

    images: torch.Tensor  # [n, C, H, W], standardised like the data
    labels: torch.Tensor
    cosine_loss: float  # 1 - cosine similarity of the best start
    losses: list[float] = field(default_factory=list)  # of every start


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference between neighbouring pixels (the images' total variation, per pixel)."""
    return (images[..., 1:, :] - images[..., :-1, :]).abs().mean() + (
        images[..., :, 1:] - images[..., :, :-1]
    ).abs().mean()


def cosine_loss(simulated: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """1 - cosine similarity of a simulated update and the received one, over every parameter at once."""
    flat = torch.cat([simulated[name].reshape(-1) for name in simulated])
    return 1.0 - F.cosine_similarity(flat, target, dim=0, eps=1e-12)


def _matched(copies: Sequence[torch.Tensor], labels: torch.Tensor) -> list[torch.Tensor]:
    """For each copy, the order of its rows that best matches copy 0's rows of the same label (Hungarian)."""
    orders = [torch.arange(len(labels))]
    reference = copies[0].detach().flatten(1)
    for copy in copies[1:]:
        rows = copy.detach().flatten(1)
        order = torch.arange(len(labels))
        for label in labels.unique():
            where = torch.nonzero(labels == label).flatten()
            cost = torch.cdist(reference[where], rows[where]).pow(2).numpy()
            left, right = linear_sum_assignment(cost)
            order[where[left]] = where[right]
        orders.append(order)
    return orders


def invert(
    model: nn.Module,
    start: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    training: LocalTraining,
    *,
    labels: torch.Tensor,
    known: tuple[torch.Tensor, torch.Tensor] | None,
    box: tuple[torch.Tensor, torch.Tensor],
    shape: tuple[int, ...],
    options: ReconstructionOptions,
    generator: torch.Generator,
) -> Inversion:
    """Inverting Gradients on one update: the records (with ``labels``; ``known`` records fixed beside them) whose
    simulated local training best matches ``target`` in cosine similarity, under a total-variation prior and the
    pixel box; the best of ``options.restarts`` random starts."""
    unknown = len(labels)
    known_x, known_y = known if known is not None else (torch.empty((0, *shape)), torch.empty(0, dtype=torch.long))
    all_labels = torch.cat([labels, known_y])
    records = len(all_labels)
    copies_needed = training.copies(records)
    plan = training.plan(records, generator)
    flat_target = torch.cat([target[name].reshape(-1) for name in start]).detach()
    low, high = (b.view(1, -1, 1, 1) for b in box)
    best: Inversion | None = None
    losses = []
    milestones = [int(options.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
    for _ in range(options.restarts):
        copies = [
            torch.randn((unknown, *shape), generator=generator).clamp(low, high).requires_grad_(True)
            for _ in range(copies_needed)
        ]
        optimizer = torch.optim.Adam(copies, lr=options.learning_rate)
        schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
        orders = [torch.arange(unknown)] * copies_needed
        for iteration in range(options.iterations):
            if copies_needed > 1 and iteration % MATCH_EVERY == 0:
                orders = _matched(copies, labels)
            optimizer.zero_grad()
            full = [torch.cat([c, known_x]) for c in copies]
            loss = cosine_loss(simulate_update(model, start, full, all_labels, training, plan), flat_target)
            loss = loss + options.tv_weight * sum(total_variation(c) for c in copies) / copies_needed
            if copies_needed > 1:
                aligned = torch.stack([c[o] for c, o in zip(copies, orders)])
                loss = loss + options.order_weight * (aligned - aligned.mean(0, keepdim=True)).pow(2).mean()
            loss.backward()
            optimizer.step()
            schedule.step()
            with torch.no_grad():
                for c in copies:
                    c.copy_(torch.maximum(torch.minimum(c, high), low))
        with torch.no_grad():
            orders = _matched(copies, labels) if copies_needed > 1 else orders
            images = torch.stack([c.detach()[o] for c, o in zip(copies, orders)]).mean(0)
        full = [torch.cat([c.detach(), known_x]) for c in copies]
        final = float(
            cosine_loss(simulate_update(model, start, full, all_labels, training, plan), flat_target).detach()
        )
        losses.append(final)
        if best is None or final < best.cosine_loss:
            best = Inversion(images=images, labels=labels, cosine_loss=final)
    best.losses = losses
    return best


def attack_update(
    model: nn.Module,
    start: dict[str, torch.Tensor],
    update: dict[str, torch.Tensor],
    training: LocalTraining,
    *,
    unknown: int,
    known: tuple[torch.Tensor, torch.Tensor] | None,
    num_classes: int,
    box: tuple[torch.Tensor, torch.Tensor],
    shape: tuple[int, ...],
    options: ReconstructionOptions,
    generator: torch.Generator,
) -> Inversion:
    """The whole attack on one received update, as the server runs it: the ``unknown`` records' labels (of shape
    ``shape``) from the bias update, then :func:`invert` (``known``: records the server knows the client trained on
    beside them)."""
    labels = recover_labels(
        model,
        start,
        update,
        training,
        unknown=unknown,
        known_labels=known[1] if known else torch.empty(0, dtype=torch.long),
        num_classes=num_classes,
        box=box,
        shape=shape,
        generator=generator,
    )
    return invert(
        model,
        start,
        update,
        training,
        labels=labels,
        known=known,
        box=box,
        shape=shape,
        options=options,
        generator=generator,
    )


# ----------------------------------------------------------------------------------------------------------------
# Planning: which updates, and everything checked before anything is computed


@dataclass(frozen=True)
class ReconstructionPlan:
    """A run's targets, and what the attack reads for them (checked: they exist and fit)."""

    targets: tuple[ReconstructionTarget, ...]
    kinds: dict[int, str]  # round -> UPDATE_SIGNAL or SYNTHETIC_SIGNAL


def view_of_round(algorithm: str, round_number: int) -> str:
    """What a client of ``algorithm`` sent in a round: a model update or a synthetic set."""
    if ALGORITHMS[algorithm].sends_synthetic(round_number):
        return SYNTHETIC_SIGNAL
    return UPDATE_SIGNAL


def plan_targets(run: RunDirectory, config: RunConfig, manifest: Manifest, target: str | None) -> ReconstructionPlan:
    """The (round, client) pairs ``--target`` names, each checked to have crossed the wire and to be attackable;
    a run without saved transmissions, a round or client that does not exist, a client that did not take part, a
    missing starting model or an unsupported model is an :class:`AttackError` (one sentence), before any work."""
    algorithm = config.federated.algorithm
    if algorithm not in ALGORITHMS:
        raise AttackError(f"{run.path} is a {algorithm} run, which --method {METHOD} cannot attack.")
    rounds_spec, client = parse_target(target)
    done = manifest.rounds_done
    if done < 1:
        raise AttackError(f"{run.path} has no completed round yet, so nothing has crossed the wire.")
    sent = _sent_rounds(run, done)
    if not sent:
        raise AttackError(
            f"{run.path} was trained without --save-transmitted, so it kept nothing that crossed the wire to "
            f"reconstruct from; train it again with --save-transmitted."
        )
    if rounds_spec == "first-final":
        rounds = sorted({1, done})
    elif rounds_spec == "final":
        rounds = [done]
    elif rounds_spec == "all":
        rounds = sorted(sent)
    else:
        rounds = [int(rounds_spec)]
    num_clients = len(manifest.clients.num_examples)
    if client is not None and client >= num_clients:
        raise AttackError(f"--target names client {client}, but {run.path} has clients 0 to {num_clients - 1}.")
    targets = []
    for number in rounds:
        if number > done:
            raise AttackError(f"--target names round {number}, but {run.path} has completed rounds 1 to {done}.")
        if number not in sent:
            raise AttackError(
                f"{run.path} kept no transmissions of round {number} under transmitted/ (the rounds kept: "
                f"{_listed(sorted(sent))})."
            )
        clients = sent[number]
        if client is not None:
            if client not in clients:
                raise AttackError(
                    f"Client {client} did not take part in round {number} of {run.path} (clients that did: "
                    f"{_listed(clients)})."
                )
            clients = [client]
        targets += [ReconstructionTarget(number, k) for k in clients]
    kinds = {number: view_of_round(algorithm, number) for number in rounds}
    spec = run.model_spec()
    window = ssim_window(spec.input_shape[1], spec.input_shape[2])
    if window is None:
        raise AttackError(
            f"{run.path} holds {spec.input_shape[1]}x{spec.input_shape[2]} records; a reconstruction is judged by "
            f"SSIM, which needs images of at least {MIN_SSIM_SIDE}x{MIN_SSIM_SIDE} pixels."
        )
    if UPDATE_SIGNAL in kinds.values():
        _check_model(run, spec)
        for target in targets:
            if kinds[target.round] == UPDATE_SIGNAL:
                _check_update(run, config, manifest, target)
    return ReconstructionPlan(tuple(targets), kinds)


def _listed(values: Sequence[int]) -> str:
    return ", ".join(map(str, values)) or "none"


def _sent_rounds(run: RunDirectory, done: int) -> dict[int, list[int]]:
    """Round -> the clients whose transmission was kept, for the committed rounds."""
    sent: dict[int, list[int]] = {}
    if not run.transmitted_dir.is_dir():
        return sent
    for folder in sorted(run.transmitted_dir.glob("round-[0-9][0-9][0-9][0-9]")):
        number = int(folder.name.split("-")[1])
        clients = sorted(int(f.stem.split("-")[1]) for f in folder.glob("client-[0-9][0-9][0-9].safetensors"))
        if 1 <= number <= done and clients:
            sent[number] = clients
    return sent


def _check_model(run: RunDirectory, spec: ModelSpec) -> None:
    """The model must end in a linear layer with a bias over the classes (the labels are read from it) and let the
    attack differentiate its gradient with respect to its input (double backward)."""
    model = build_model(spec)
    name = bias_name(model, spec.num_classes)
    if name is None:
        raise AttackError(
            f"The model of {run.path} ({spec.arch}) does not end in a linear layer with a bias over the "
            f"{spec.num_classes} classes, from whose update --method {METHOD} recovers the labels."
        )
    model.eval()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.zeros((1, *spec.input_shape), requires_grad=True)
    training = LocalTraining(steps=1, batch_size=1, lr=1.0, full_batch=True)
    try:
        delta = simulate_update(model, params, [x], torch.zeros(1, dtype=torch.long), training, [(0, torch.arange(1))])
        torch.autograd.grad(sum(d.sum() for d in delta.values()), x, allow_unused=True)
    except RuntimeError as exc:
        raise AttackError(
            f"The model of {run.path} ({spec.arch}) cannot be differentiated twice, which gradient inversion "
            f"needs ({str(exc).splitlines()[0]})."
        ) from exc


def _check_update(run: RunDirectory, config: RunConfig, manifest: Manifest, target: ReconstructionTarget) -> None:
    """What simulating this update reads must be there: the round's starting model, SCAFFOLD's control variates,
    Fedssyn's share, and an update that fits the model; and the client must not average too many records."""
    number = target.round
    if number > 1 and not run.checkpoints.path(number - 1).is_file():
        raise AttackError(
            f"{run.path} no longer keeps the checkpoint of round {number - 1} (--keep-checkpoints), the global model "
            f"round {number} started from, so its updates cannot be inverted."
        )
    algorithm = config.federated.algorithm
    if ALGORITHMS[algorithm].generation_rounds and not _share(run, number, target.client):
        raise AttackError(
            f"{run.path} does not hold the synthetic share client {target.client} trained on in round {number} "
            f"(no checkpoints/round-NNNN-clients.safetensors up to round {number - 1} has it)."
        )
    records = manifest.clients.num_examples[target.client] + len(_share(run, number, target.client).get("labels", []))
    if records > MAX_RECORDS:
        raise AttackError(
            f"Client {target.client} of {run.path} trains on {records} records per round; --method {METHOD} inverts "
            f"updates of at most {MAX_RECORDS} (gradient inversion recovers nothing recognisable from larger "
            "batches); use a run with smaller clients."
        )
    shapes = {name: tuple(p.shape) for name, p in build_model(run.model_spec()).named_parameters()}
    sent = load_tensors(_sent_path(run, target))
    if any(name not in sent or tuple(sent[name].shape) != shape for name, shape in shapes.items()):
        raise AttackError(f"{_sent_path(run, target)} does not hold a model update that fits the run's model.")


def _sent_path(run: RunDirectory, target: ReconstructionTarget) -> Path:
    return run.transmitted_dir / f"round-{target.round:04d}" / f"client-{target.client:03d}.safetensors"


def _share(run: RunDirectory, round_number: int, client: int) -> dict[str, torch.Tensor]:
    """Fedssyn: the synthetic records the server dealt ``client``, which it trained on from round 2 on (empty in
    round 1 or for other algorithms)."""
    if round_number < 2:
        return {}
    state = run.states.at(round_number - 1, clients=[client]).get(client, {})
    if "synthetic/images" not in state or "synthetic/labels" not in state:
        return {}
    return {"images": state["synthetic/images"], "labels": state["synthetic/labels"]}


def _local_algorithm(config: RunConfig) -> AlgorithmEntry:
    """The algorithm whose local training made a run's updates: the run's own, or the inner algorithm of one that
    runs another after its generation rounds (Fedssyn's ``--inner-algorithm``)."""
    entry = ALGORITHMS[config.federated.algorithm]
    return ALGORITHMS[config.fedssyn.inner_algorithm] if entry.inner_algorithms else entry


def recipe(config: RunConfig, records: int, round_number: int) -> LocalTraining:
    """The recipe of local training of a client with ``records`` records in ``round_number``, as the run's
    configuration tells the server (without SCAFFOLD's control variates, which :func:`local_training` adds)."""
    fed, privacy = config.federated, config.privacy
    generation = ALGORITHMS[fed.algorithm].generation_rounds  # the inner algorithm's rounds start after them
    rounds, index = fed.rounds - generation, round_number - 1 - generation
    inner = _local_algorithm(config)
    lr = fed.client_lr
    if fed.lr_schedule != "constant":
        lr = lr * 0.5 * (1.0 + math.cos(math.pi * index / rounds))
    if inner.one_step:
        steps = 1
    elif fed.local_steps is not None:
        steps = fed.local_steps
    else:
        steps = fed.local_epochs * max(1, records // fed.batch_size)
    return LocalTraining(
        steps=steps,
        batch_size=fed.batch_size,
        lr=lr,
        momentum=fed.momentum,
        mu=fed.mu if inner.proximal else 0.0,
        full_batch=inner.one_step and not privacy.dp,
        max_grad_norm=privacy.max_grad_norm if privacy.dp else None,
    )


def local_training(
    run: RunDirectory, config: RunConfig, manifest: Manifest, target: ReconstructionTarget, params: dict[str, Any]
) -> LocalTraining:
    """The recipe of client ``target.client``'s local training in ``target.round``, as the run's configuration
    and its checkpoints (SCAFFOLD's control variates c and c_k of the round's start) tell the server."""
    training = recipe(config, manifest.clients.num_examples[target.client], target.round)
    if not _local_algorithm(config).control_variates:
        return training
    server = run.states.load_server(target.round - 1) if target.round > 1 else {}
    clients = run.states.at(target.round - 1, clients=[target.client]) if target.round > 1 else {}
    own_control = clients.get(target.client, {})
    correction = {
        name: server.get(name, torch.zeros_like(p)) - own_control.get(name, torch.zeros_like(p))
        for name, p in params.items()
    }
    return replace(training, correction=correction)


def estimate_seconds(
    config: RunConfig, spec: ModelSpec, dataset: Dataset, records: int, targets: int, options: ReconstructionOptions
) -> float:
    """About how long the audit of ``targets`` updates of clients with ``records`` records takes here: a few
    iterations of the attack on a random update, timed, scaled to its iterations, starts and null."""
    if ALGORITHMS[config.federated.algorithm].wire == WIRE_SYNTHETIC or not targets:
        return 0.0
    records = min(records, MAX_RECORDS)
    model = build_model(spec)
    model.eval()
    start = {name: p.detach() for name, p in model.named_parameters()}
    training = recipe(config, records, 1)
    generator = torch.Generator().manual_seed(0)
    update = _random_like(start, generator)
    labels = torch.zeros(records, dtype=torch.long)
    probe = replace(options, iterations=2, restarts=1)
    began = time.perf_counter()
    invert(
        model,
        start,
        update,
        training,
        labels=labels,
        known=None,
        box=pixel_range(dataset.train_x),
        shape=tuple(spec.input_shape),
        options=probe,
        generator=generator,
    )
    per_iteration = (time.perf_counter() - began) / 3  # two iterations and the final match
    return per_iteration * options.iterations * options.restarts * 2 * targets


# ----------------------------------------------------------------------------------------------------------------
# One target: attack, null, metrics, result


@dataclass(frozen=True)
class Outcome:
    """What :func:`reconstruct` found about one target."""

    name: str
    records: pd.DataFrame
    images: dict[str, torch.Tensor]
    metrics: dict[str, Any]


def _generator(seed: int, target: ReconstructionTarget, purpose: int) -> torch.Generator:
    """A generator of its own for each target and purpose (0: the attack, 1: its null), derived from the attack's
    seed, so that the same seed reconstructs the same records whatever else is attacked."""
    base = derive_seed(seed, Stream.ATTACK, Draw.RECONSTRUCTION)
    state = np.random.SeedSequence([base & 0xFFFFFFFF, base >> 32, target.round, target.client, purpose])
    generator = torch.Generator()
    generator.manual_seed(int(state.generate_state(2, np.uint32).astype(np.uint64)[0]))
    return generator


def reconstruct(
    run: RunDirectory,
    config: RunConfig,
    manifest: Manifest,
    dataset: Dataset,
    partition: Partition,
    target: ReconstructionTarget,
    kind: str,
    *,
    seed: int,
    options: ReconstructionOptions,
    accountant_epsilon: float | None,
) -> Outcome:
    """Attack one transmission and its null, and judge both against the client's real records."""
    began = time.perf_counter()
    low, high = pixel_range(dataset.train_x)
    own = torch.from_numpy(partition.clients[target.client].copy())
    reals = to_pixels(dataset.train_x[own], low, high)
    real_labels = dataset.train_y[own].numpy()
    sent = load_tensors(_sent_path(run, target))
    if kind == UPDATE_SIGNAL:
        attack, null, details = _invert_update(run, config, manifest, dataset, target, sent, seed, options)
        guesses, null_guesses = to_pixels(attack.images, low, high), to_pixels(null.images, low, high)
        matched, null_matched = assign(guesses, reals), assign(null_guesses, reals)
        guessed_labels, null_labels = attack.labels.numpy(), null.labels.numpy()
        null_images = np.arange(len(null_guesses))
        sources = ("reconstructed", "reconstructed")
    else:
        guesses, guessed_labels, null_guesses, null_images, null_labels, split = _sent_and_held_out(
            sent, dataset, partition, target, seed, low, high
        )
        matched, null_matched = nearest(guesses, reals), nearest(null_guesses, reals)
        details = {"synthetic_images": len(guesses), "null_records_from": split}
        sources = ("sent", split)
    psnrs, ssims = pair_quality(guesses, reals[matched])
    null_psnrs, null_ssims = pair_quality(null_guesses, reals[null_matched])
    threshold = options.psnr_threshold
    judged = (own, real_labels)  # the client's records and their labels
    table = pd.concat(
        [
            _ranked(kind, sources[0], np.arange(len(guesses)), matched, guessed_labels, psnrs, ssims, *judged),
            _ranked(
                NULL_KIND[kind], sources[1], null_images, null_matched, null_labels, null_psnrs, null_ssims, *judged
            ),
        ],
        ignore_index=True,
    )
    table["recovered"] = table["psnr"] >= threshold
    best = _best_first(psnrs)[:SHOWN]  # the figure's pairs
    label_match = _label_agreement(guessed_labels, real_labels[matched]) if kind == UPDATE_SIGNAL else None
    quality = quality_summary(psnrs, ssims, threshold)
    null_quality = quality_summary(null_psnrs, null_ssims, threshold)
    metrics = {
        "signal": kind,
        "method": METHOD,
        "target": f"round:{target.round}:client:{target.client}",
        "round": target.round,
        "client": target.client,
        "seed": seed,
        "algorithm": config.federated.algorithm,
        "dp": config.privacy.dp,
        "noise_multiplier": config.privacy.noise_multiplier if config.privacy.dp else None,
        "client_records": int(len(own)),
        "num_records": int(len(guesses)),
        **quality,
        "label_accuracy": label_match,
        "null": {"kind": NULL_KIND[kind], **null_quality},
        "no_better_than_null": no_better(psnrs, null_psnrs),
        "accountant_epsilon": accountant_epsilon,
        "settings": asdict(options),  # iterations, restarts, psnr_threshold, learning_rate, tv and order weights
        "attack": details,
        "seconds": time.perf_counter() - began,
    }
    shown = {"reconstructed": guesses[best], "original": reals[matched[best]], "psnr": psnrs[best]}
    return Outcome(target.name, table, {key: torch.from_numpy(value).float() for key, value in shown.items()}, metrics)


def _sent_and_held_out(
    sent: Mapping[str, torch.Tensor],
    dataset: Dataset,
    partition: Partition,
    target: ReconstructionTarget,
    seed: int,
    low: torch.Tensor,
    high: torch.Tensor,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """A synthetic set as sent (pixels and labels) and its null, held-out records of the same labels: the null's
    pixels, which records, their labels and where they come from."""
    images = sent["images"].to(torch.float32)
    labels = sent["labels"].numpy() if "labels" in sent else np.full(len(images), -1)
    held, null_images, split, null_labels = _held_out(dataset, partition, labels, target, seed)
    return to_pixels(images, low, high), labels, to_pixels(held, low, high), null_images, null_labels, split


def _ranked(
    kind: str,
    source: str,
    index: np.ndarray,
    match: np.ndarray,
    labels: np.ndarray,
    psnrs: np.ndarray,
    ssims: np.ndarray,
    own: torch.Tensor,
    real_labels: np.ndarray,
) -> pd.DataFrame:
    """One kind's rows of the reconstruction table, best PSNR first: each image, the client's record it matches, the
    labels, and the quality of the match."""
    order = _best_first(psnrs)
    return pd.DataFrame(
        {
            "kind": kind,
            "rank": np.arange(len(order)),
            "image": index[order],
            "image_source": source,
            "record": own.numpy()[match[order]],
            "label": real_labels[match[order]],
            "label_guessed": labels[order],
            "psnr": psnrs[order],
            "ssim": ssims[order],
        }
    )


def _best_first(psnrs: np.ndarray) -> np.ndarray:
    """Indices from the best reconstruction (highest PSNR, the worst case for privacy) to the worst."""
    return np.argsort(-psnrs, kind="stable")


def no_better(attack: np.ndarray, null: np.ndarray) -> bool | None:
    """Whether the attack's mean PSNR is no better than its null's: Welch's one-sided t-test of "the attack's mean is
    above the null's" does not reject at 2.5% (None with fewer than two of either). Both means are estimates: the
    attack's interval against the null's mean alone called equal attacks better in 7-8% of samples."""
    # an exact copy's PSNR is infinite: as good as PSNR_CEILING, so that means and spreads exist
    attack, null = (np.minimum(np.asarray(x, float), PSNR_CEILING) for x in (attack, null))
    if len(attack) < 2 or len(null) < 2:
        return None
    if attack.std() == 0 and null.std() == 0:
        return bool(attack.mean() <= null.mean())
    return bool(stats.ttest_ind(attack, null, equal_var=False, alternative="greater").pvalue >= NULL_LEVEL)


def _label_agreement(guessed: np.ndarray, real: np.ndarray) -> dict[str, Any]:
    """How many of the recovered labels are right as a multiset (the order of a batch is unknown): sum over classes
    of min(guessed, real) over n, with its interval."""
    classes = int(max(guessed.max(initial=0), real.max(initial=0))) + 1
    right = int(np.minimum(np.bincount(guessed, minlength=classes), np.bincount(real, minlength=classes)).sum())
    return {"fraction": right / len(real), "ci95": rate_interval(right, len(real)), "right": right, "n": len(real)}


def _held_out(
    dataset: Dataset, partition: Partition, labels: np.ndarray, target: ReconstructionTarget, seed: int
) -> tuple[torch.Tensor, np.ndarray, str, np.ndarray]:
    """The null of a synthetic set: as many real records that no client holds (the held-out pool, else the test
    split), of the synthetic images' classes where there are any, drawn with the attack's generator."""
    generator = _generator(seed, target, 1)
    pool_x, pool_y, source = dataset.train_x, dataset.train_y, "holdout"
    index = torch.from_numpy(partition.holdout.copy())
    if not len(index):
        pool_x, pool_y, source = dataset.test_x, dataset.test_y, "test"
        index = torch.arange(len(pool_y))
    chosen = []
    for label in labels:
        candidates = index[pool_y[index] == int(label)] if label >= 0 else index
        candidates = candidates if len(candidates) else index
        chosen.append(int(candidates[torch.randint(len(candidates), (1,), generator=generator)]))
    picked = torch.tensor(chosen, dtype=torch.long)
    return pool_x[picked], picked.numpy(), source, pool_y[picked].numpy()


def _invert_update(
    run: RunDirectory,
    config: RunConfig,
    manifest: Manifest,
    dataset: Dataset,
    target: ReconstructionTarget,
    sent: dict[str, torch.Tensor],
    seed: int,
    options: ReconstructionOptions,
) -> tuple[Inversion, Inversion, dict[str, Any]]:
    """Inverting Gradients on the client's update and on a random update of the same norm."""
    spec = run.model_spec()
    model = build_model(spec)
    model.eval()
    start = (
        initial_params(spec, config.seed)
        if target.round == 1
        else {name: t for name, t in run.checkpoints.params(target.round - 1).items()}
    )
    start = {name: start[name].to(torch.float32) for name, _ in model.named_parameters()}
    training = local_training(run, config, manifest, target, start)
    share = _share(run, target.round, target.client) if ALGORITHMS[config.federated.algorithm].generation_rounds else {}
    known = (share["images"].to(torch.float32), share["labels"].long()) if share else None
    unknown = manifest.clients.num_examples[target.client]
    box = pixel_range(dataset.train_x)
    shape = tuple(spec.input_shape)
    update = {name: sent[name].to(torch.float32) for name in start}
    results = [
        attack_update(
            model,
            start,
            received,
            training,
            unknown=unknown,
            known=known,
            num_classes=spec.num_classes,
            box=box,
            shape=shape,
            options=options,
            generator=_generator(seed, target, purpose),
        )
        for purpose, received in ((0, update), (1, _random_like(update, _generator(seed, target, 2))))
    ]
    attack, null = results
    details = {
        "threat_model": "the server: it knows the round's global model, the model, the client's number of records "
        "and the recipe of its local training, and receives its update",
        "local_steps": training.steps,
        "batch_size": training.batch_size,
        "simulated_epochs": training.copies(unknown + (len(known[1]) if known else 0)),
        "dp_step": "expected clipped mean" if training.max_grad_norm is not None else None,
        "known_records": len(known[1]) if known else 0,
        "labels": "iDLG (one record)" if unknown == 1 and not known else "counts from the bias update",
        "cosine_loss": attack.cosine_loss,
        "cosine_loss_per_start": attack.losses,
        "null_cosine_loss": null.cosine_loss,
        "update_norm": float(torch.cat([u.reshape(-1) for u in update.values()]).norm()),
    }
    return attack, null, details


def _random_like(update: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A Gaussian direction over every parameter, scaled to the update's norm: an update that carries no record."""
    noise = {name: torch.randn(u.shape, generator=generator) for name, u in update.items()}
    scale = torch.cat([u.reshape(-1) for u in update.values()]).norm() / torch.cat(
        [n.reshape(-1) for n in noise.values()]
    ).norm().clamp(min=1e-30)
    return {name: n * scale for name, n in noise.items()}


def result_files(outcome: Outcome) -> dict[str, bytes]:
    """The files of a result directory besides metrics.json: records.csv and images.safetensors."""
    return {
        "records.csv": csv_bytes(outcome.records),
        "images.safetensors": tensors_bytes(outcome.images, {"target": outcome.metrics["target"]}),
    }


def _interval_text(summary: dict[str, Any], digits: int) -> str:
    """ "mean [low, high]" of a summary, or the mean alone without an interval."""
    if summary.get("mean") is None:
        return "-"
    text = f"{summary['mean']:.{digits}f}"
    return text + (f" [{summary['ci95'][0]:.{digits}f}, {summary['ci95'][1]:.{digits}f}]" if summary["ci95"] else "")


def console_table(metrics: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per reconstruction result for the console: its quality and its null's, with intervals and n."""
    rows = []
    for m in metrics:
        recovered = m["recovered"]
        fraction = "-" if recovered["fraction"] is None else f"{recovered['fraction']:.3f}"
        if recovered["ci95"]:
            fraction += f" [{recovered['ci95'][0]:.3f}, {recovered['ci95'][1]:.3f}]"
        labels = m.get("label_accuracy")
        rows.append(
            {
                "run": m["run"],
                "round": m["round"],
                "client": m["client"],
                "view": m["signal"],
                "n": m["num_records"],
                "PSNR dB [95%]": _interval_text(m["psnr"], 2),
                "SSIM [95%]": _interval_text(m["ssim"], 3),
                f"recovered >= {recovered['threshold_db']:g} dB": fraction,
                "null": m["null"]["kind"],
                "null PSNR dB [95%]": _interval_text(m["null"]["psnr"], 2),
                "labels right": "-" if not labels else f"{labels['right']}/{labels['n']}",
                "eps": "no DP" if m["accountant_epsilon"] is None else f"{m['accountant_epsilon']:.3f}",
                "s": f"{m['seconds']:.1f}",
            }
        )
    return pd.DataFrame(rows)

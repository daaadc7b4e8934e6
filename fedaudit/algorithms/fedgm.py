"""FedGM: one-shot federated learning by gradient matching, with label differential privacy (Chen et al., 2024).

Each client distils its records into a small synthetic set, ``distill_ipc`` images per class it holds, by
class-wise gradient matching as in dataset condensation (Zhao et al., 2021): on a sequence of freshly initialised
networks, the synthetic images of class c move so that the network's gradient on them matches its gradient on a
real batch of class c (the layer-wise cosine distance of FedLAP's matching loss), and the network takes a step on
the synthetic set between matching steps. The set is a function of the client's data and of its own distillation
stream (its round generator at the reserved round key :data:`DISTILL_ROUND`; under label DP derived from the
client's secret like all its draws), so the client makes the same set in every round and keeps nothing between
rounds: fedaudit persists what clients keep on the server's side for
``--resume``, and the set's true labels and its unsent stages must never leave the client. (The local engine
reuses the set it made in an earlier round of the same process.)

The client releases its set once, in T stages: the run's rounds. A seeded permutation that never looks at the
labels splits the set into T parts; in round t the client sends part t, its images in clear and its labels through
a label-DP mechanism (``--label-epsilon``): RR, RRTop-k or RRWithPrior, whose prior is the softmax of the server's
model after stage t - 1 (uniform in the first stage, where every mechanism is RR). The server keeps everything it
received and trains its model on the union, from the previous stage's model (``--server-steps`` SGD steps at the
client learning rate, momentum 0.9). Each label is released exactly once, so the whole run is
``label_epsilon``-label-DP (fedaudit.privacy.labeldp).

This protects the labels only. The images are optimised with full access to the real records and sent in clear:
FedGM has no record-level DP guarantee, and the ledger says so. Without ``--label-epsilon`` the labels are sent in
clear too (FedGM without DP). Left out from the paper: its k-means choice of "representative" real batches (real
batches are drawn at random here) and its 300 x 100 matching iterations (defaults sized for a CPU:
``--distill-iterations 20 --distill-steps 10``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedaudit.algorithms.base import (
    SGD,
    ClientData,
    ClientMessage,
    RoundContext,
    ServerResult,
    TensorDict,
    num_classes,
)
from fedaudit.algorithms.fedgm_settings import FedGMConfig
from fedaudit.algorithms.fedlap import matched_names, matching_loss, real_images
from fedaudit.config import RunConfig
from fedaudit.models import fresh_params
from fedaudit.privacy.labeldp import randomized_response, rr_top_k, rr_with_prior
from fedaudit.privacy.randomness import Source

DISTILL_ROUND = 2**32 - 1  # the round key of a client's distillation stream: no round of a run has it

NET_LR = 0.01  # SGD step of the matching network on the synthetic set (dataset condensation's)
SERVER_BATCH = 256
SERVER_MOMENTUM = 0.9


class FedGM:
    """FedGM: synthetic sets made once by class-wise gradient matching, released in stages under label DP."""

    name = "fedgm"

    def __init__(self, config: RunConfig | None = None) -> None:
        """Built from the run's configuration (see :mod:`fedaudit.registry`)."""
        self._made: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]] = {}

    def queries_per_round(self, config: RunConfig, num_examples: int) -> int:
        """FedGM makes no record-level DP query (its guarantee is label DP)."""
        return 0

    def client_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        state: TensorDict | None = None,
    ) -> ClientMessage:
        """Make the synthetic set (or reuse it), then send this round's stage with randomized labels."""
        gm = ctx.config.fedgm
        images, labels, stage, metrics = self._synthetic_set(model, global_params, data, ctx)
        part = stage == ctx.round
        images, labels = images[part], labels[part]
        if gm.label_epsilon is not None:
            labels = self._randomize(model, global_params, images, labels, ctx, data.next_query())
        return ClientMessage(
            client_id=data.client_id,
            num_examples=data.num_examples,
            payload={"images": images, "labels": labels},
            metrics={**metrics, "images_sent": float(len(labels))},
        )

    def _synthetic_set(
        self, model: nn.Module, global_params: TensorDict, data: ClientData, ctx: RoundContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
        """(images, true labels, stage of each image, distillation metrics) of this client, the same in every round.
        The set is put in the order of a permutation that never looks at the labels, and cut into the stages in that
        order: a stage's images are sent in an order that tells nothing of their labels (distilled class by class,
        they would be sorted by class, and their randomized labels decoded by position)."""
        if data.draws is None:
            raise RuntimeError("FedGM's client makes its set from its own draws: run it through run_client.")
        keys = data.draws.keys
        seed = keys.round_seed(DISTILL_ROUND)
        key = (data.client_id, data.x.data_ptr(), data.num_examples, seed, ctx.config.fedgm, ctx.rounds)
        if key not in self._made:
            device = data.x.device
            generator = keys.round_generator(DISTILL_ROUND, device)
            images, labels, first, last = distil(model, global_params, data, ctx.config.fedgm, generator)
            order = torch.randperm(len(labels), generator=generator, device=generator.device).to(labels.device)
            images, labels = images[order], labels[order]  # distilled class by class: sent in this order instead
            stage = torch.arange(len(labels), device=labels.device) * ctx.rounds // len(labels)
            self._made[key] = images, labels, stage, {"matching_loss_first": first, "matching_loss_last": last}
        return self._made[key]

    def server_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        messages: list[ClientMessage],
        ctx: RoundContext,
        generator: torch.Generator,
    ) -> ServerResult:
        """Train the previous stage's model on everything received so far; keep it for the next stages."""
        received = [ctx.server_kept] if ctx.server_kept else []
        received += [m.payload for m in messages]
        images = torch.cat([r["images"].to(ctx.device) for r in received])
        labels = torch.cat([r["labels"].to(ctx.device) for r in received])
        params = {name: p.detach().clone().requires_grad_(True) for name, p in global_params.items()}
        optimizer = SGD(list(params.values()), lr=ctx.config.federated.client_lr, momentum=SERVER_MOMENTUM)
        losses = []
        steps = ctx.config.fedgm.server_steps if len(labels) else 0
        order = torch.empty(0, dtype=torch.long)
        for _ in range(steps):
            if len(order) == 0:
                order = torch.randperm(len(labels), generator=generator, device=generator.device).to(ctx.device)
            idx, order = order[:SERVER_BATCH], order[SERVER_BATCH:]
            loss = F.cross_entropy(functional_call(model, params, (images[idx],)), labels[idx])
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        train_loss = float(torch.stack(losses).double().mean()) if losses else math.nan
        return ServerResult(
            params={name: p.detach() for name, p in params.items()},
            metrics={"server_images": float(len(labels)), "server_train_loss": train_loss},
            kept={"images": images, "labels": labels},
        )

    @staticmethod
    def _randomize(
        model: nn.Module,
        global_params: TensorDict,
        images: torch.Tensor,
        labels: torch.Tensor,
        ctx: RoundContext,
        generator: Source,
    ) -> torch.Tensor:
        """The labels through the configured mechanism, with the server model's prior from the second stage on;
        ``generator`` is the round's label query's own source."""
        gm = ctx.config.fedgm
        classes = num_classes(model, global_params, images)
        if ctx.round == 0 or gm.label_mechanism == "rr":  # no model of earlier stages yet: a uniform prior, RR
            return randomized_response(labels, classes, gm.label_epsilon, generator)
        with torch.no_grad():
            detached = {name: p.detach() for name, p in global_params.items()}
            prior = F.softmax(functional_call(model, detached, (images,)), dim=1).to(torch.float64)
        if gm.label_mechanism == "rr-top-k":
            return rr_top_k(labels, prior, min(gm.top_k, classes), gm.label_epsilon, generator)
        return rr_with_prior(labels, prior, gm.label_epsilon, generator)


def distil(
    model: nn.Module, global_params: TensorDict, data: ClientData, gm: FedGMConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Class-wise gradient matching: (images, labels, first and last matching loss)."""
    classes = torch.unique(data.y).sort().values
    labels = classes.repeat_interleave(gm.distill_ipc)
    members = {int(c): torch.nonzero(data.y == c).flatten() for c in classes}
    if gm.distill_init == "real":
        start = real_images(data, classes, gm.distill_ipc, generator)
    else:
        shape = (len(labels), *data.x.shape[1:])
        start = torch.randn(shape, generator=generator, device=generator.device, dtype=data.x.dtype).to(data.x.device)
    images = start.requires_grad_(True)
    image_opt = SGD([images], lr=gm.distill_lr, momentum=0.5)
    matched = matched_names(model, global_params)
    first = last = None
    for _ in range(gm.distill_iterations):
        params = {name: p.requires_grad_(True) for name, p in fresh_params(model, global_params, generator).items()}
        net_opt = SGD(list(params.values()), lr=NET_LR)
        for _ in range(gm.distill_steps):
            total = images.new_zeros(())
            for c in classes:
                pool = members[int(c)]
                pick = torch.randint(
                    len(pool), (min(gm.distill_batch, len(pool)),), generator=generator, device=generator.device
                ).to(pool.device)
                real_loss = F.cross_entropy(functional_call(model, params, (data.x[pool[pick]],)), data.y[pool[pick]])
                real = [g.detach() for g in torch.autograd.grad(real_loss, [params[name] for name in matched])]
                mine = labels == c
                syn_loss = F.cross_entropy(functional_call(model, params, (images[mine],)), labels[mine])
                syn = torch.autograd.grad(syn_loss, [params[name] for name in matched], create_graph=True)
                total = total + matching_loss(real, syn, 0.0)
            image_opt.zero_grad(set_to_none=False)
            (images.grad,) = torch.autograd.grad(total, [images])
            image_opt.step()
            first = total.detach() if first is None else first
            last = total.detach()
            net_loss = F.cross_entropy(functional_call(model, params, (images.detach(),)), labels)
            net_opt.zero_grad(set_to_none=False)
            net_loss.backward()
            net_opt.step()
    return images.detach(), labels, float(first), float(last)

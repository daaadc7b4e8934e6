"""FedDM: clients share synthetic sets made by distribution matching around the global model (Xiong et al., 2023).

Every round, client k starts ``dm_ipc`` synthetic images per class it holds from random real images of the class
(labels fixed) and runs ``dm_iterations`` steps. Each step samples a network on the sphere of radius rho
(``--dm-radius``) around the global model, w_g + rho u / ||u|| with u standard normal over all parameters, and
moves the images (SGD, ``--dm-lr``, momentum 0.5) to reduce, summed over classes c,

    || mean embedding of a real batch of class c - mean embedding of the synthetic images of class c ||^2
    + || the same for the logits ||^2

(the embedding is the input of the model's last linear layer). This is distribution matching (Zhao and Bilen,
2023) on networks near the current model, so the synthetic set stands for the client's data where the server will
train. The client sends the set. The server trains the global model on the union (each client's images weighted
N_k / N, as ``--weighting`` says) with the client learning rate for at most ``--server-epochs`` epochs, inside the
ball of radius rho around w_g, where the matched networks came from.

FedDM runs without DP here: its paper's DP variant protects class-wise statistics, and the FedLAP-DP paper calls
its privacy notion incomparable; `--dp` is refused. The synthetic images are class-conditional means of real
embeddings baked into images and are sent in clear (``--signal synthetic-distance`` audits them).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call

from fedaudit.algorithms.base import (
    SGD,
    ClientData,
    ClientMessage,
    RoundContext,
    ServerResult,
    TensorDict,
)
from fedaudit.algorithms.fedlap import fit_in_ball, real_images, weighted_union
from fedaudit.config import RunConfig

SERVER_BATCH = 256


class FedDM:
    """FedDM: distribution-matched synthetic sets every round, the server's training kept inside the sampling ball."""

    name = "feddm"

    def __init__(self, config: RunConfig | None = None) -> None:
        """Built from the run's configuration (see :mod:`fedaudit.registry`)."""

    def queries_per_round(self, config: RunConfig, num_examples: int) -> int:
        """FedDM makes no DP query (it runs without DP)."""
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
        """Match a synthetic set to the client's class-wise mean embeddings and logits near the global model."""
        dm = ctx.config.feddm
        classes = torch.unique(data.y).sort().values
        labels = classes.repeat_interleave(dm.dm_ipc)
        members = {int(c): torch.nonzero(data.y == c).flatten() for c in classes}
        images = real_images(data, classes, dm.dm_ipc, generator).requires_grad_(True)
        optimizer = SGD([images], lr=dm.dm_lr, momentum=0.5)
        head = _last_linear(model)
        first = last = None
        for _ in range(dm.dm_iterations):
            params = sphere_sample(global_params, dm.dm_radius, generator)
            loss = images.new_zeros(())
            for c in classes:
                pool = members[int(c)]
                size = min(dm.dm_batch, len(pool))
                pick = torch.randint(len(pool), (size,), generator=generator, device=generator.device)
                with torch.no_grad():
                    real_embedding, real_logits = _embed(model, head, params, data.x[pool[pick.to(pool.device)]])
                syn_embedding, syn_logits = _embed(model, head, params, images[labels == c])
                loss = loss + (real_embedding.mean(0) - syn_embedding.mean(0)).pow(2).sum()
                loss = loss + (real_logits.mean(0) - syn_logits.mean(0)).pow(2).sum()
            optimizer.zero_grad(set_to_none=False)
            (images.grad,) = torch.autograd.grad(loss, [images])
            optimizer.step()
            first = loss.detach() if first is None else first
            last = loss.detach()
        return ClientMessage(
            client_id=data.client_id,
            num_examples=data.num_examples,
            payload={"images": images.detach(), "labels": labels},
            metrics={
                "matching_loss_first": float(first) if first is not None else math.nan,
                "matching_loss_last": float(last) if last is not None else math.nan,
            },
        )

    def server_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        messages: list[ClientMessage],
        ctx: RoundContext,
        generator: torch.Generator,
    ) -> ServerResult:
        """Train on the union of the synthetic sets, weighted per client, until ||w - w_g|| >= rho."""
        images, labels, sample_weights = weighted_union(messages, ctx)
        fit = fit_in_ball(
            model,
            global_params,
            origin=global_params,
            images=images,
            labels=labels,
            sample_weights=sample_weights,
            lr=ctx.cosine_lr(ctx.config.federated.client_lr),
            epochs=ctx.config.fedlap.server_epochs,
            radius=ctx.config.feddm.dm_radius,
            batch_size=SERVER_BATCH,
            generator=generator,
            use_augment=False,
        )
        return ServerResult(
            params=fit.params,
            metrics={
                "server_iterations": fit.steps,
                "server_distance": fit.distance,
                "matching_loss_first": sum(m.metrics["matching_loss_first"] for m in messages) / len(messages),
                "matching_loss_last": sum(m.metrics["matching_loss_last"] for m in messages) / len(messages),
            },
        )


def sphere_sample(center: TensorDict, radius: float, generator: torch.Generator) -> TensorDict:
    """center + radius * u / ||u||, u standard normal over all parameters flattened into one vector."""
    noise = {
        name: torch.randn(p.shape, generator=generator, device=generator.device, dtype=p.dtype).to(p.device)
        for name, p in center.items()
    }
    norm = torch.sqrt(sum(n.pow(2).sum() for n in noise.values()))
    return {name: center[name].detach() + radius * noise[name] / norm for name in center}


def _last_linear(model: nn.Module) -> nn.Linear:
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not layers:
        raise ValueError("FedDM matches embeddings at the input of the model's last linear layer; this model has none")
    return layers[-1]


def _embed(model: nn.Module, head: nn.Linear, params: TensorDict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input of the last linear layer, the logits) of ``x`` under ``params``."""
    seen: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    try:
        logits = functional_call(model, params, (x,))
    finally:
        handle.remove()
    return torch.flatten(seen[-1], 1), logits

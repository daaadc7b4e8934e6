"""FedLAP and FedLAP-DP: clients share synthetic sets that approximate their local loss landscape.

Client k synthesises S_k (ipc images per class it holds) by matching the
gradients of its real data, layer by layer, at points along short training
trajectories that stay inside a trust region around the global model
(docs/algorithms.md). Under DP the real-gradient target is one query of
the shared DP primitive; nothing else touches real data, so the privacy cost
is that of R_i * L * R_b Sampled Gaussian Mechanism queries per round. The
server trains the global model on the union of the synthetic sets until it
leaves the trust region of radius r_g.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedaudit.algorithms.base import (
    ClientData,
    ClientMessage,
    RoundContext,
    ServerResult,
    TensorDict,
    aggregation_weights,
    clone_params,
    flat_distance,
)
from fedaudit.augment import augment
from fedaudit.config import FedLAPConfig, RunConfig
from fedaudit.privacy.accounting import SGMEvent
from fedaudit.privacy.primitive import dp_gradient, poisson_sample


def layer_distance(real: torch.Tensor, syn: torch.Tensor) -> torch.Tensor:
    """Sum over rows of (1 - cosine similarity); rows are output units, averaged for conv/linear tensors.

    Conv weights [out, in, kh, kw] become out rows of in*kh*kw, linear weights
    [out, in] out rows; 1-D parameters (biases, norm affine) are one row.
    """
    if real.dim() == 1:
        return 1.0 - F.cosine_similarity(real.unsqueeze(0), syn.unsqueeze(0), dim=1, eps=1e-8).sum()
    rows_real = real.reshape(real.shape[0], -1)
    rows_syn = syn.reshape(syn.shape[0], -1)
    return (1.0 - F.cosine_similarity(rows_real, rows_syn, dim=1, eps=1e-8)).sum() / rows_real.shape[0]


def matching_loss(real: Sequence[torch.Tensor], syn: Sequence[torch.Tensor], mse_weight: float) -> torch.Tensor:
    """L_dis = sum over parameter tensors of layer_distance + mse_weight * ||G_real - G_syn||^2."""
    total = syn[0].new_zeros(())
    for g_real, g_syn in zip(real, syn):
        total = total + layer_distance(g_real, g_syn)
        if mse_weight:
            total = total + mse_weight * (g_real - g_syn).pow(2).sum()
    return total


@dataclass(frozen=True)
class SyntheticSet:
    """A client's synthetic images and their fixed, balanced labels."""

    images: torch.Tensor
    labels: torch.Tensor


class FedLAP:
    """FedLAP (non-DP) and FedLAP-DP, selected by ``config.privacy.dp``."""

    name = "fedlap"

    def __init__(self, config: RunConfig | None = None) -> None:
        """Every algorithm is built from the run's configuration (see :mod:`fedaudit.registry`)."""

    def queries_per_round(self, config: RunConfig, num_examples: int) -> int:
        """Worst case T = R_i * L * R_b: as if the trust region never ended a loop early."""
        lap = config.fedlap
        return lap.trajectories * lap.max_loops * lap.real_batches

    def client_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        state: TensorDict | None = None,
    ) -> ClientMessage:
        """Synthesise S_k inside the trust region; the message carries S_k (and r_k without DP)."""
        lap = ctx.config.fedlap
        synthetic = self._initial_set(data, ctx, generator, state)
        images = synthetic.images.clone().requires_grad_(True)
        image_opt = torch.optim.SGD([images], lr=lap.image_lr, momentum=0.5)
        lr = ctx.cosine_lr(ctx.config.federated.client_lr)
        names = list(global_params)
        queries, loops, image_steps, first_loss, last_loss = 0, 0, 0, None, None
        max_distance, last_step_start = 0.0, 0.0
        for _ in range(lap.trajectories):
            params = clone_params(global_params)
            for loop in range(lap.max_loops):
                distance = flat_distance(params, global_params)
                max_distance = max(max_distance, distance)
                if distance >= lap.radius:
                    break
                loops += 1
                for _ in range(lap.real_batches):
                    seed = _draw_seed(generator)  # one augmentation seed shared by the real and synthetic batches
                    target = self._real_gradient(model, params, data, ctx, generator, seed)
                    queries += 1
                    for _ in range(lap.image_steps):
                        loss = self._image_step(
                            model, params, names, target, images, synthetic.labels, image_opt, lap, seed
                        )
                        image_steps += 1
                        first_loss = loss if first_loss is None else first_loss
                        last_loss = loss
                if loop == lap.max_loops - 1:
                    break
                params, moved, _, before = self._train(
                    model,
                    params,
                    global_params,
                    images.detach(),
                    synthetic.labels,
                    torch.ones(len(synthetic.labels), device=images.device),
                    lr,
                    lap.model_epochs,
                    lap.radius,
                    lap.server_batch_size,
                    generator,
                    lap.augment,
                )
                max_distance = max(max_distance, moved)
                last_step_start = max(last_step_start, before)
        final = SyntheticSet(images.detach(), synthetic.labels)
        radius = (
            lap.radius
            if ctx.config.privacy.dp
            else self._measured_radius(model, global_params, final, data, ctx, lr, generator)
        )
        events = []
        if ctx.config.privacy.dp:
            events = [
                SGMEvent(
                    noise_multiplier=ctx.config.privacy.noise_multiplier,
                    sample_rate=ctx.config.federated.batch_size / data.num_examples,
                    steps=queries,
                )
            ]
        return ClientMessage(
            client_id=data.client_id,
            num_examples=data.num_examples,
            payload={
                "images": final.images,
                "labels": final.labels,
                "radius": torch.tensor([radius], dtype=torch.float32),
            },
            metrics={
                "matching_loss_first": float(first_loss or 0.0),
                "matching_loss_last": float(last_loss or 0.0),
                "radius": float(radius),
                "loops": float(loops),
                "real_queries": float(queries),
                "image_steps": float(image_steps),
                "max_distance": max_distance,
                "max_last_step_start": last_step_start,
            },
            privacy_events=events,
            state={"images": final.images},
        )

    def server_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        messages: list[ClientMessage],
        ctx: RoundContext,
        generator: torch.Generator,
    ) -> ServerResult:
        """Train on the union of the synthetic sets, weighted per client, until ||w - w_g|| >= r_g."""
        lap = ctx.config.fedlap
        radii = [float(m.payload["radius"][0]) for m in messages]
        r_g = {"min": min, "max": max, "median": statistics.median}.get(lap.radius_strategy, min)(radii)
        if lap.radius_strategy == "fixed":
            r_g = float("inf")
        weights = aggregation_weights(messages, ctx.config.federated.weighting)
        images = torch.cat([m.payload["images"].to(ctx.device) for m in messages])
        labels = torch.cat([m.payload["labels"].to(ctx.device) for m in messages])
        # per-image weight so that client k's loss counts weight_k whatever |S_k| is
        sample_weights = torch.cat(
            [
                torch.full((len(m.payload["labels"]),), w * len(labels) / len(m.payload["labels"]), device=ctx.device)
                for w, m in zip(weights, messages)
            ]
        )
        lr = ctx.cosine_lr(ctx.config.federated.client_lr)
        params, distance, steps, before_last = self._train(
            model,
            global_params,
            global_params,
            images,
            labels,
            sample_weights,
            lr,
            lap.server_epochs,
            r_g,
            lap.server_batch_size,
            generator,
            lap.augment,
        )
        model_size = sum(p.numel() for p in global_params.values())
        transmitted = [m.payload["images"].numel() for m in messages]
        return ServerResult(
            params=params,
            metrics={
                "server_radius": r_g if r_g != float("inf") else float("nan"),
                "server_iterations": steps,
                "server_distance": distance,
                "server_distance_before_last_step": before_last,
                "client_radius_min": min(radii),
                "client_radius_max": max(radii),
                "matching_loss_first": statistics.fmean(m.metrics["matching_loss_first"] for m in messages),
                "matching_loss_last": statistics.fmean(m.metrics["matching_loss_last"] for m in messages),
                "cost_vs_model": statistics.fmean(transmitted) / model_size,
            },
        )

    def _initial_set(
        self, data: ClientData, ctx: RoundContext, generator: torch.Generator, state: TensorDict | None
    ) -> SyntheticSet:
        lap = ctx.config.fedlap
        classes = torch.unique(data.y).sort().values
        labels = classes.repeat_interleave(lap.ipc)
        shape = (len(labels), *data.x.shape[1:])
        if lap.init == "previous" and state is not None and state["images"].shape == shape:
            return SyntheticSet(state["images"].to(data.x.device), labels)
        if lap.init == "real":
            picks = []
            for c in classes:
                members = torch.nonzero(data.y == c).flatten()
                order = torch.randperm(len(members), generator=generator, device=generator.device)
                chosen = members[order[: lap.ipc]]
                picks.append(chosen[torch.arange(lap.ipc, device=chosen.device) % len(chosen)])
            return SyntheticSet(data.x[torch.cat(picks)].clone(), labels)
        noise = torch.randn(shape, generator=generator, device=generator.device, dtype=data.x.dtype)
        return SyntheticSet(noise.to(data.x.device), labels)

    def _real_gradient(
        self,
        model: nn.Module,
        params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        seed: int,
    ) -> list[torch.Tensor]:
        """The matching target at ``params``: one DP query (Poisson batch), or a plain batch gradient without DP."""
        batch = ctx.config.federated.batch_size
        n = data.num_examples
        if ctx.config.privacy.dp:
            idx = poisson_sample(n, min(1.0, batch / n), generator=generator)
            x, y = data.x[idx], data.y[idx]
            if ctx.config.fedlap.augment:
                x = augment(x, seed=seed)
            result = dp_gradient(
                model,
                x,
                y,
                noise_multiplier=ctx.config.privacy.noise_multiplier,
                max_grad_norm=ctx.config.privacy.max_grad_norm,
                expected_batch_size=batch,
                generator=generator,
                params=params,
            )
            return [result.grads[name] for name in params]
        idx = torch.randperm(n, generator=generator, device=generator.device)[:batch]
        x, y = data.x[idx], data.y[idx]
        if ctx.config.fedlap.augment:
            x = augment(x, seed=seed)
        leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
        loss = F.cross_entropy(functional_call(model, leaves, (x,)), y)
        return [g.detach() for g in torch.autograd.grad(loss, list(leaves.values()))]

    def _image_step(
        self,
        model: nn.Module,
        params: TensorDict,
        names: list[str],
        target: list[torch.Tensor],
        images: torch.Tensor,
        labels: torch.Tensor,
        image_opt: torch.optim.Optimizer,
        lap: FedLAPConfig,
        seed: int,
    ) -> float:
        """One second-order update of the synthetic images towards the real gradient."""
        leaves = {name: params[name].detach().requires_grad_(True) for name in names}
        x = augment(images, seed=seed) if lap.augment else images
        loss = F.cross_entropy(functional_call(model, leaves, (x,)), labels)
        syn = torch.autograd.grad(loss, [leaves[name] for name in names], create_graph=True)
        distance = matching_loss(target, syn, lap.mse_weight)
        image_opt.zero_grad(set_to_none=False)
        (images.grad,) = torch.autograd.grad(distance, [images])
        image_opt.step()
        return float(distance.detach())

    def _train(
        self,
        model: nn.Module,
        start: TensorDict,
        origin: TensorDict,
        images: torch.Tensor,
        labels: torch.Tensor,
        sample_weights: torch.Tensor,
        lr: float,
        epochs: int,
        radius: float,
        batch_size: int,
        generator: torch.Generator,
        use_augment: bool,
    ) -> tuple[TensorDict, float, int, float]:
        """SGD on (images, labels) from ``start``; stops after the step that leaves the ball of ``radius`` around ``origin``.

        Returns the parameters, their distance from ``origin``, the number of steps and the distance before the
        last step (inside the ball unless no step was taken): the radius is exceeded by at most one step.
        """
        params = {name: p.detach().clone().requires_grad_(True) for name, p in start.items()}
        optimizer = torch.optim.SGD(list(params.values()), lr=lr)
        steps = 0
        distance = before = flat_distance(params, origin)
        for _ in range(epochs):
            if distance >= radius:
                break
            order = torch.randperm(len(labels), generator=generator, device=generator.device)
            for idx in order.split(batch_size):
                x = images[idx]
                if use_augment:
                    x = augment(x, seed=_draw_seed(generator))
                losses = F.cross_entropy(functional_call(model, params, (x,)), labels[idx], reduction="none")
                loss = (losses * sample_weights[idx]).mean()
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                optimizer.step()
                steps += 1
                before, distance = distance, flat_distance(params, origin)
                if distance >= radius:
                    break
        return {name: p.detach() for name, p in params.items()}, distance, steps, before

    def _measured_radius(
        self,
        model: nn.Module,
        global_params: TensorDict,
        synthetic: SyntheticSet,
        data: ClientData,
        ctx: RoundContext,
        lr: float,
        generator: torch.Generator,
    ) -> float:
        """Non-DP r_k: distance from w_g where training on S_k reaches the smallest loss on the real data, capped at r."""
        lap = ctx.config.fedlap
        params = {name: p.detach().clone().requires_grad_(True) for name, p in global_params.items()}
        optimizer = torch.optim.SGD(list(params.values()), lr=lr)
        best_loss, best_distance = self._real_loss(model, params, data), 0.0
        for _ in range(lap.server_epochs):
            order = torch.randperm(len(synthetic.labels), generator=generator, device=generator.device)
            for idx in order.split(lap.server_batch_size):
                loss = F.cross_entropy(functional_call(model, params, (synthetic.images[idx],)), synthetic.labels[idx])
                optimizer.zero_grad(set_to_none=False)
                loss.backward()
                optimizer.step()
            distance = flat_distance(params, global_params)
            real_loss = self._real_loss(model, params, data)
            if real_loss < best_loss:
                best_loss, best_distance = real_loss, distance
            if distance >= lap.radius:
                break
        return min(best_distance, lap.radius)

    @staticmethod
    def _real_loss(model: nn.Module, params: TensorDict, data: ClientData, batch_size: int = 2048) -> float:
        with torch.no_grad():
            detached = {name: p.detach() for name, p in params.items()}
            total = 0.0
            for start in range(0, data.num_examples, batch_size):
                out = functional_call(model, detached, (data.x[start : start + batch_size],))
                total += float(F.cross_entropy(out, data.y[start : start + batch_size], reduction="sum"))
        return total / data.num_examples


def _draw_seed(generator: torch.Generator) -> int:
    """A seed for one augmentation draw, taken from the client's or server's stream."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))

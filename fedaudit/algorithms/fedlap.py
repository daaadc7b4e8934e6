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
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedaudit.algorithms.base import (
    EVAL_BATCH,
    SGD,
    ClientData,
    ClientMessage,
    RoundContext,
    ServerResult,
    TensorDict,
    aggregation_weights,
    clone_params,
    flat_distance,
)
from fedaudit.algorithms.fedlap_settings import FedLAPConfig
from fedaudit.config import RunConfig
from fedaudit.cuda_graph import GraphedStep, graphs_enabled
from fedaudit.models import inert_parameters
from fedaudit.models.augment import augment
from fedaudit.privacy.accounting import SGMEvent
from fedaudit.privacy.primitive import dp_gradient


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


def matched_names(model: nn.Module, params: TensorDict) -> list[str]:
    """The parameters whose gradients are matched: all but those that cannot change the model's output (a
    convolution's bias before per-channel normalisation, :func:`fedaudit.models.inert_parameters`). Their exact
    gradient is zero for real and synthetic data alike; the computed one is rounding noise, and matching it put
    noise worth a quarter of the image gradient into every image step."""
    inert = inert_parameters(model)
    return [name for name in params if name not in inert]


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


@dataclass
class _MatchingStats:
    """Counters of one client's matching, reported in its message's metrics."""

    queries: int = 0  # real-gradient targets computed (one DP query each under DP)
    loops: int = 0  # loops started inside the trust region, over all trajectories
    image_steps: int = 0
    first_loss: torch.Tensor | None = None  # matching loss of the first and of the last image step (kept on the
    last_loss: torch.Tensor | None = None  # device: reading a loss back each step would stall an accelerator)
    max_distance: float = 0.0  # largest ||w - w_g|| seen
    last_step_start: float = 0.0  # largest distance before the step that left the trust region

    def image_step(self, loss: torch.Tensor) -> None:
        self.image_steps += 1
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss

    def moved(self, fit: Fit) -> None:
        self.max_distance = max(self.max_distance, fit.distance)
        self.last_step_start = max(self.last_step_start, fit.before_last)

    def metrics(self, radius: float) -> dict[str, float]:
        return {
            "matching_loss_first": 0.0 if self.first_loss is None else float(self.first_loss),
            "matching_loss_last": 0.0 if self.last_loss is None else float(self.last_loss),
            "radius": float(radius),
            "loops": float(self.loops),
            "real_queries": float(self.queries),
            "image_steps": float(self.image_steps),
            "max_distance": self.max_distance,
            "max_last_step_start": self.last_step_start,
        }


@dataclass(frozen=True)
class _Matching:
    """What one client's matching works on: its data and round, and the synthetic images with their optimiser."""

    model: nn.Module
    global_params: TensorDict
    data: ClientData
    ctx: RoundContext
    generator: torch.Generator
    images: torch.Tensor  # the synthetic images, a leaf that requires grad
    labels: torch.Tensor
    image_opt: SGD
    lr: float  # the client's learning rate this round
    matched: list[str]  # the parameters whose gradients are matched (matched_names)
    graphed: GraphedStep | None = None  # the image step as a CUDA graph (on CUDA, without augmentation), else None

    @property
    def lap(self) -> FedLAPConfig:
        return self.ctx.config.fedlap


@dataclass(frozen=True)
class Fit:
    """Where SGD on a synthetic set ended: parameters, distance from the origin, steps, and distance before the last
    step (inside the ball unless no step was taken)."""

    params: TensorDict
    distance: float
    steps: int
    before_last: float


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
        work = _Matching(
            model=model,
            global_params=global_params,
            data=data,
            ctx=ctx,
            generator=generator,
            images=images,
            labels=synthetic.labels,
            image_opt=SGD([images], lr=lap.image_lr, momentum=0.5),
            lr=ctx.cosine_lr(ctx.config.federated.client_lr),
            matched=matched_names(model, global_params),
        )
        if graphs_enabled(images.device) and not lap.augment:  # augmentation draws at random: not replayable
            work = replace(work, graphed=GraphedStep(partial(_image_update, work, seed=0)))
        stats = _MatchingStats()
        for _ in range(lap.trajectories):
            self._trajectory(work, stats)
        final = SyntheticSet(images.detach(), synthetic.labels)
        dp = ctx.config.privacy.dp
        radius = lap.radius if dp else self._measured_radius(model, global_params, final, data, ctx, work.lr, generator)
        events = []
        if dp:
            sample_rate = ctx.config.federated.batch_size / data.num_examples
            events = [
                SGMEvent(
                    noise_multiplier=ctx.config.privacy.noise_multiplier, sample_rate=sample_rate, steps=stats.queries
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
            metrics=stats.metrics(radius),
            privacy_events=events,
            state={"images": final.images},
        )

    def _trajectory(self, work: _Matching, stats: _MatchingStats) -> None:
        """One trajectory R_i from the global model: up to L loops of matching, each followed (but the last) by
        R_l epochs on the synthetic set, until the parameters leave the trust region of radius r."""
        lap = work.lap
        params = clone_params(work.global_params)
        for loop in range(lap.max_loops):
            distance = flat_distance(params, work.global_params)
            stats.max_distance = max(stats.max_distance, distance)
            if distance >= lap.radius:
                return
            stats.loops += 1
            self._match(work, params, stats)
            if loop == lap.max_loops - 1:
                return
            fit = fit_in_ball(
                work.model,
                params,
                origin=work.global_params,
                images=work.images.detach(),
                labels=work.labels,
                sample_weights=torch.ones(len(work.labels), device=work.images.device),
                lr=work.lr,
                epochs=lap.model_epochs,
                radius=lap.radius,
                batch_size=lap.server_batch_size,
                generator=work.generator,
                use_augment=lap.augment,
            )
            params = fit.params
            stats.moved(fit)

    def _match(self, work: _Matching, params: TensorDict, stats: _MatchingStats) -> None:
        """One loop at ``params``: R_b real-gradient targets (one DP query each), J image steps towards each."""
        lap = work.lap
        for _ in range(lap.real_batches):
            seed = _draw_seed(work.generator)  # one augmentation seed shared by the real and synthetic batches
            target = self._real_gradient(work, params, seed)
            stats.queries += 1
            for _ in range(lap.image_steps):
                stats.image_step(self._image_step(work, params, target, seed))

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
        images, labels, sample_weights = weighted_union(messages, ctx)
        lr = ctx.cosine_lr(ctx.config.federated.client_lr)
        fit = fit_in_ball(
            model,
            global_params,
            origin=global_params,
            images=images,
            labels=labels,
            sample_weights=sample_weights,
            lr=lr,
            epochs=lap.server_epochs,
            radius=r_g,
            batch_size=lap.server_batch_size,
            generator=generator,
            use_augment=lap.augment,
        )
        model_size = sum(p.numel() for p in global_params.values())
        transmitted = [m.payload["images"].numel() for m in messages]
        return ServerResult(
            params=fit.params,
            metrics={
                "server_radius": r_g if r_g != float("inf") else float("nan"),
                "server_iterations": fit.steps,
                "server_distance": fit.distance,
                "server_distance_before_last_step": fit.before_last,
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
            return SyntheticSet(real_images(data, classes, lap.ipc, generator), labels)
        noise = torch.randn(shape, generator=generator, device=generator.device, dtype=data.x.dtype)
        return SyntheticSet(noise.to(data.x.device), labels)

    def _real_gradient(self, work: _Matching, params: TensorDict, seed: int) -> list[torch.Tensor]:
        """The matching target at ``params``, for the matched parameters: one DP query over all parameters (Poisson
        batch; keeping some of its output is post-processing), or a plain batch gradient without DP."""
        model, data, ctx, generator = work.model, work.data, work.ctx, work.generator
        batch = ctx.config.federated.batch_size
        n = data.num_examples
        if ctx.config.privacy.dp:
            x, y, extra, source = data.dp_batch(min(1.0, batch / n))  # canaries are records: same q, same query
            if ctx.config.fedlap.augment:
                x = augment(x, seed=seed)
            result = dp_gradient(
                model,
                x,
                y,
                noise_multiplier=ctx.config.privacy.noise_multiplier,
                max_grad_norm=ctx.config.privacy.max_grad_norm,
                expected_batch_size=batch,
                generator=source,
                params=params,
                extra=extra,
                recorder=data.recorder,
            )
            return [result.grads[name] for name in work.matched]
        idx = torch.randperm(n, generator=generator, device=generator.device)[:batch]
        x, y = data.x[idx], data.y[idx]
        if ctx.config.fedlap.augment:
            x = augment(x, seed=seed)
        leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
        loss = F.cross_entropy(functional_call(model, leaves, (x,)), y)
        return [g.detach() for g in torch.autograd.grad(loss, [leaves[name] for name in work.matched])]

    def _image_step(self, work: _Matching, params: TensorDict, target: list[torch.Tensor], seed: int) -> torch.Tensor:
        """One second-order update of the synthetic images towards the real gradient ``target`` at ``params``
        (replayed as a CUDA graph where it can be, :mod:`fedaudit.cuda_graph`)."""
        if work.graphed is not None:
            return work.graphed(params, target)
        return _image_update(work, params, target, seed)

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
        """Non-DP r_k: distance from w_g where training on S_k reaches the smallest loss on the real data, capped at
        r."""
        lap = ctx.config.fedlap
        params = {name: p.detach().clone().requires_grad_(True) for name, p in global_params.items()}
        optimizer = SGD(list(params.values()), lr=lr)
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
    def _real_loss(model: nn.Module, params: TensorDict, data: ClientData, batch_size: int = EVAL_BATCH) -> float:
        with torch.no_grad():
            detached = {name: p.detach() for name, p in params.items()}
            total = 0.0
            for start in range(0, data.num_examples, batch_size):
                out = functional_call(model, detached, (data.x[start : start + batch_size],))
                total += float(F.cross_entropy(out, data.y[start : start + batch_size], reduction="sum"))
        return total / data.num_examples


def weighted_union(messages: list[ClientMessage], ctx: RoundContext) -> tuple[torch.Tensor, ...]:
    """The union of the synthetic sets the clients sent: (images, labels, per-image weights), each image weighted
    so that client k's loss counts its aggregation weight whatever the size of its set (FedLAP's and FedDM's
    server)."""
    weights = aggregation_weights(messages, ctx.config.federated.weighting)
    images = torch.cat([m.payload["images"].to(ctx.device) for m in messages])
    labels = torch.cat([m.payload["labels"].to(ctx.device) for m in messages])
    sample_weights = torch.cat(
        [
            torch.full((len(m.payload["labels"]),), w * len(labels) / len(m.payload["labels"]), device=ctx.device)
            for w, m in zip(weights, messages)
        ]
    )
    return images, labels, sample_weights


def real_images(data: ClientData, classes: torch.Tensor, ipc: int, generator: torch.Generator) -> torch.Tensor:
    """``ipc`` random records of each class, in class order (repeated if a class has fewer): a synthetic set's
    start from real data (FedLAP's ``--init real``, FedGM's and FedDM's)."""
    picks = []
    for c in classes:
        members = torch.nonzero(data.y == c).flatten()
        order = torch.randperm(len(members), generator=generator, device=generator.device).to(members.device)
        chosen = members[order[:ipc]]
        picks.append(chosen[torch.arange(ipc, device=chosen.device) % len(chosen)])
    return data.x[torch.cat(picks)].clone()


def fit_in_ball(
    model: nn.Module,
    start: TensorDict,
    *,
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
) -> Fit:
    """SGD on (images, labels) from ``start``; stops after the step that leaves the ball of ``radius`` around
    ``origin`` (FedLAP's and FedDM's server; FedLAP's model epochs between loops).

    The radius is exceeded by at most one step (see :class:`Fit`).
    """
    params = {name: p.detach().clone().requires_grad_(True) for name, p in start.items()}
    optimizer = SGD(list(params.values()), lr=lr)
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
    return Fit({name: p.detach() for name, p in params.items()}, distance, steps, before)


def _image_update(work: _Matching, params: TensorDict, target: list[torch.Tensor], seed: int) -> torch.Tensor:
    """The image step: the matching loss between ``target`` and the synthetic gradient at ``params``, and one SGD
    step of the images down its gradient; returns the loss. It writes the images and their momentum in place and
    branches on no tensor's value, so it can be captured as a CUDA graph."""
    lap = work.lap
    leaves = {name: params[name].detach().requires_grad_(True) for name in work.global_params}
    x = augment(work.images, seed=seed) if lap.augment else work.images
    loss = F.cross_entropy(functional_call(work.model, leaves, (x,)), work.labels)
    syn = torch.autograd.grad(loss, [leaves[name] for name in work.matched], create_graph=True)
    distance = matching_loss(target, syn, lap.mse_weight)
    (work.images.grad,) = torch.autograd.grad(distance, [work.images])
    work.image_opt.step()
    return distance.detach()


def _draw_seed(generator: torch.Generator) -> int:
    """A seed for one augmentation draw, taken from the client's or server's stream."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))

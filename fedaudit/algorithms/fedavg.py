"""Gradient-sharing baselines: FedAvg, FedProx, FedSGD and their DP variants, record-level and client-level.

Clients run local SGD from the global model and send their model delta; the server adds the weighted mean delta
times the server learning rate. With record-level DP, every local step is one query of the shared DP primitive on a
Poisson batch (DP-FedAvg / DP-FedProx, "local DP-SGD"). With client-level DP (``--dp-level client``) the clients
train without DP and the server releases the mean of their updates clipped to C with noise sigma C on the sum,
divided by the expected number of clients (McMahan et al. 2018), drawn from its own secret. FedProx's proximal
gradient mu (w - w_g) is added *after* the noise: it does not touch data, so it costs no privacy, and putting it
into the loss would be discarded by the clipping (a known bug of DP-FedProx implementations; docs/algorithms.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fedaudit.algorithms.base import (
    SGD,
    ClientData,
    ClientMessage,
    RoundContext,
    ServerResult,
    TensorDict,
    aggregation_weights,
    clone_params,
    load_params,
)
from fedaudit.config import RunConfig
from fedaudit.privacy.accounting import SGMEvent, update_noise_multiplier
from fedaudit.privacy.primitive import client_level_mean, client_noise_share, dp_gradient
from fedaudit.privacy.randomness import Source, add_gaussian, source_device

CLIP_NORM = "clip_norm"  # adaptive clipping: the server's state, C of the next round


class FedAvg:
    """FedAvg, with record-level DP-SGD on the clients under ``--dp`` (DP-FedAvg); the base of FedProx and FedSGD."""

    name = "fedavg"
    mu = 0.0  # weight of FedProx's proximal term
    single_step = False  # FedSGD: one local step per round
    # the loss of a batch without DP (the DP primitive's per-example loss is cross-entropy too); tests replace it
    # with a quadratic to check the algorithms against closed forms
    loss = staticmethod(F.cross_entropy)

    def __init__(self, config: RunConfig | None = None) -> None:
        """Every algorithm is built from the run's configuration (see :mod:`fedaudit.registry`)."""

    def queries_per_round(self, config: RunConfig, num_examples: int) -> int:
        """Local steps per round (each one DP query under DP): one for FedSGD, ``local_steps`` if set, else E *
        floor(N_k / B)."""
        if self.single_step:
            return 1
        if config.federated.local_steps is not None:
            return config.federated.local_steps
        return config.federated.local_epochs * max(1, num_examples // config.federated.batch_size)

    def client_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        state: TensorDict | None = None,
    ) -> ClientMessage:
        """Local training from the global model; the message carries the model delta (with the noise in shares,
        clipped and with the client's share of the noise)."""
        delta, events, metrics = self.local_update(model, global_params, data, ctx, generator)
        return ClientMessage(
            client_id=data.client_id,
            num_examples=data.num_examples,
            payload=self.sent_update(delta, data, ctx),
            metrics=metrics,
            privacy_events=events,
        )

    @staticmethod
    def sent_update(delta: TensorDict, data: ClientData, ctx: RoundContext) -> TensorDict:
        """What the client sends of its model delta: the delta, or with the noise in shares (``--noise-at
        clients``) the delta clipped to C with the client's share of the noise, drawn from its own secret."""
        return _share(delta, ctx, data.next_query()) if ctx.config.privacy.noise_in_shares else delta

    def local_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        correction: TensorDict | None = None,
    ) -> tuple[TensorDict, list[SGMEvent], dict[str, float]]:
        """Local SGD (DP-SGD under DP) from the global model: (model delta, privacy events, metrics). A DP run's
        metrics hold no training loss (without noise, a function of the client's records).

        ``correction`` is added to every step's gradient after the DP noise, like FedProx's proximal gradient
        (SCAFFOLD's c - c_k): it does not depend on the batch, so it costs no privacy.
        """
        fed = ctx.config.federated
        load_params(model, global_params)
        model.train()
        optimizer = SGD(model.parameters(), lr=ctx.cosine_lr(fed.client_lr), momentum=fed.momentum)
        if ctx.config.privacy.record_level:
            events, metrics = self._train_dp(model, optimizer, global_params, data, ctx, generator, correction)
        else:
            events, metrics = [], self._train_plain(model, optimizer, global_params, data, ctx, generator, correction)
            if ctx.config.privacy.client_level:  # a client's loss is a function of its data, without noise
                metrics.pop("train_loss", None)
        delta = {name: p.detach() - global_params[name] for name, p in model.named_parameters()}
        return delta, events, metrics

    def server_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        messages: list[ClientMessage],
        ctx: RoundContext,
        generator: torch.Generator,
    ) -> ServerResult:
        """w_g <- w_g + eta_s * sum_k weight_k * delta_k; at client level, w_g + eta_s * the released mean update
        (``generator`` is then the source of the server's noise, from its secret)."""
        if ctx.config.privacy.client_level:
            return self._client_level_update(global_params, messages, ctx, generator)
        weights = aggregation_weights(messages, ctx.config.federated.weighting)
        new = clone_params(global_params)
        for weight, message in zip(weights, messages):
            for name in new:
                new[name] += ctx.config.federated.server_lr * weight * message.payload[name].to(new[name].device)
        return ServerResult(params=new)

    def _client_level_update(
        self, global_params: TensorDict, messages: list[ClientMessage], ctx: RoundContext, generator: torch.Generator
    ) -> ServerResult:
        """The client-level DP round: every update weighs the same, clipped to C, noised, over q P clients; with
        adaptive clipping, C is this round's (broadcast as the server's state) and the noisy count of the updates
        under it moves C towards the target quantile for the next round."""
        config = ctx.config
        priv = config.privacy
        expected = config.federated.client_fraction * (ctx.population or config.data.num_clients)
        if priv.noise_in_shares:
            return self._sum_of_shares(global_params, messages, ctx, expected, generator)
        adaptive = priv.clipping == "adaptive"
        clip = (
            float(ctx.server_state[CLIP_NORM]) if adaptive and CLIP_NORM in ctx.server_state else priv.max_update_norm
        )
        count_noise = priv.count_noise_for(config.federated.client_fraction * config.data.num_clients)
        mean, norms = client_level_mean(
            [message.payload for message in messages],
            global_params,
            max_update_norm=clip,
            noise_multiplier=update_noise_multiplier(priv.noise_multiplier, count_noise)
            if adaptive
            else priv.noise_multiplier,
            expected_clients=expected,
            generator=generator,
        )
        new = {name: p + config.federated.server_lr * mean[name] for name, p in clone_params(global_params).items()}
        state = {}
        if adaptive:  # the centred count of updates under C, noised, over q P: the fraction b of the rule
            centred = torch.tensor(  # where the server's source draws (a CUDA generator draws on the GPU only)
                float((norms <= clip).double().sum()) - len(norms) / 2,
                dtype=torch.float64,
                device=source_device(generator),
            )
            fraction = float(add_gaussian(centred, count_noise, generator)) / expected + 0.5
            step = -priv.clip_lr * (fraction - priv.target_quantile)  # kept finite: e^700 is float64's edge
            following = clip * math.exp(min(700.0, max(-700.0, step)))
            state = {CLIP_NORM: torch.tensor(following, dtype=torch.float64)}
        real = torch.tensor([m.client_id < config.data.num_clients for m in messages], dtype=torch.bool)
        norms = norms[real.to(norms.device)] if len(norms) else norms  # canary clients' updates are not the clients'
        clipped = float((norms > clip).double().mean()) if len(norms) else 0.0
        median = float(norms.double().median()) if len(norms) else float("nan")
        metrics = {"clipped_updates": clipped, "update_norm_median": median, "clip_norm": clip}
        return ServerResult(params=new, metrics=metrics, state=state)

    def _adjust(self, model: nn.Module, global_params: TensorDict, correction: TensorDict | None) -> None:
        """What is added to a step's gradient after the noise: FedProx's mu (w - w_g) and a drift correction."""
        if self.mu > 0:
            for name, p in model.named_parameters():
                p.grad.add_(p.detach() - global_params[name], alpha=self.mu)
        if correction is not None:
            for name, p in model.named_parameters():
                p.grad.add_(correction[name])

    @staticmethod
    def _sum_of_shares(
        global_params: TensorDict,
        messages: list[ClientMessage],
        ctx: RoundContext,
        expected: float,
        generator: torch.Generator,
    ) -> ServerResult:
        """Client-level DP with the noise in shares: the clients' updates come clipped, each with its share of the
        noise (on their own, or under secure aggregation already added up: then each client's message comes empty
        and one message holds the sum); the server adds the canary clients' it runs (clipped and noised alike, from
        its own source), and moves the model by the sum over q P. It sees no update before its noise, so it reports
        no norm."""
        config = ctx.config
        total = {name: torch.zeros_like(p) for name, p in global_params.items()}
        for message in messages:
            payload = message.payload
            if not payload:  # a client whose update the server received only inside the secure sum
                continue
            if message.client_id >= config.data.num_clients:  # a canary client: the server runs it
                payload = _share(payload, ctx, generator)
            for name in total:
                total[name] += payload[name].to(total[name].device, total[name].dtype)
        step = config.federated.server_lr / expected
        return ServerResult(params={name: p + step * total[name] for name, p in global_params.items()})

    def _train_plain(
        self,
        model: nn.Module,
        optimizer: SGD,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        correction: TensorDict | None,
    ) -> dict[str, float]:
        fed = ctx.config.federated
        n = data.num_examples
        if self.single_step:
            batches = [torch.arange(n, device=data.x.device)]
        elif fed.local_steps is not None:
            batches = []
            while len(batches) < fed.local_steps:  # shuffled epochs, cut at the step budget
                batches += list(torch.randperm(n, generator=generator, device=generator.device).split(fed.batch_size))
            batches = batches[: fed.local_steps]
        else:
            batches = [
                batch
                for _ in range(fed.local_epochs)
                for batch in torch.randperm(n, generator=generator, device=generator.device).split(fed.batch_size)
            ]
        losses = []
        for idx in batches:
            optimizer.zero_grad(set_to_none=False)
            loss = self.loss(model(data.x[idx]), data.y[idx])
            loss.backward()
            self._adjust(model, global_params, correction)
            optimizer.step()
            losses.append(loss.detach())
        return {"train_loss": float(torch.stack(losses).double().mean()), "local_steps": float(len(batches))}

    def _train_dp(
        self,
        model: nn.Module,
        optimizer: SGD,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        correction: TensorDict | None,
    ) -> tuple[list[SGMEvent], dict[str, float]]:
        priv = ctx.config.privacy
        batch_size = ctx.config.federated.batch_size
        n = data.num_examples
        sample_rate = batch_size / n
        steps = self.queries_per_round(ctx.config, n)
        for _ in range(steps):
            x, y, extra, source = data.dp_batch(sample_rate)  # canaries are records: same q, same query
            result = dp_gradient(
                model,
                x,
                y,
                noise_multiplier=priv.noise_multiplier,
                max_grad_norm=priv.max_grad_norm,
                expected_batch_size=batch_size,
                generator=source,
                extra=extra,
                recorder=data.recorder,
            )
            for name, p in model.named_parameters():
                p.grad = result.grads[name]
            self._adjust(model, global_params, correction)
            optimizer.step()
        event = SGMEvent(noise_multiplier=priv.noise_multiplier, sample_rate=sample_rate, steps=steps)
        return [event], {"local_steps": float(steps)}


def _share(update: TensorDict, ctx: RoundContext, source: Source) -> TensorDict:
    """``update`` clipped to C with one share of the round's noise from ``source`` (the noise in shares)."""
    priv = ctx.config.privacy
    share, _ = client_noise_share(
        update,
        max_update_norm=priv.max_update_norm,
        noise_multiplier=priv.noise_multiplier,
        participants=ctx.participants,
        generator=source,
    )
    return share


class FedProx(FedAvg):
    """FedProx: FedAvg whose clients add the proximal gradient mu (w - w_g) after the DP noise."""

    name = "fedprox"

    def __init__(self, config: RunConfig | None = None) -> None:
        self.mu = 0.1 if config is None else config.federated.mu


class FedSGD(FedAvg):
    """FedSGD: one local step (one DP query) per round."""

    name = "fedsgd"
    single_step = True

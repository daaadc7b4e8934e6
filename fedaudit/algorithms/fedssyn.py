"""Fedssyn: synthetic data shuffling against data heterogeneity (Li et al., 2023).

Round 1 is the generation round, in which every client takes part whatever ``--client-fraction`` says. Client k
draws ``generator_fraction`` (rho) of its records at random, trains a class-conditional generator on them
(:mod:`fedaudit.models.generative`) and generates ``synthetic_per_client`` (n~) records whose labels follow the class
frequencies of those records; it sends them (``images``, ``labels``) and the global model is left as it was. The
server concatenates every client's records, shuffles them and deals every client an equal share of n~, which the
client keeps for the rest of the run (:attr:`ServerResult.dealt`).

From round 2 on, the inner algorithm (``--inner-algorithm``: FedAvg, FedProx, SCAFFOLD or FedSGD) runs unchanged on
every client's own records plus its share; its rounds are counted from the second (its learning-rate schedule
sees R - 1 rounds). As in the paper, a client takes as many local steps as the inner algorithm would on its own
records alone, E floor(N_k / B), so the shuffled records change what a step sees, not how many steps there are.

Privacy. Without ``--dp`` nothing is protected: the generated records, and the model updates on the real records,
leak like FedAvg's. With ``--dp`` both phases are record-level DP through the one DP primitive, on the same
records, so their costs add (sequential composition) in the one ledger:
- generation round: the class counts (one Gaussian query at rate 1, noise sigma per class; a record's one-hot
  label has norm 1) and the generator's DP-SGD (``generator_epochs`` * floor(m / B_g) steps at rate B_g / m, where
  m = floor(rho N_k), clipping ``generator_clip``), both at the run's noise multiplier; charged to every record of
  the client, whether or not it was drawn into the m (no amplification by that draw is claimed);
- later rounds: the inner algorithm's DP-SGD on own plus dealt records, sampled together at rate
  B / (N_k + n~) (the dealt records are DP outputs already: post-processing).
What the other clients receive (the shuffled records) is covered by the generation round's share of the budget.

Canaries (``--dp --canaries N``) take part in both phases as records of their client: in the class counts (an input
canary with its label; a gradient canary contributes nothing there), in every step of the generator (never left out
by the draw of rho: every record is charged as if drawn), and in every later round's steps at rate B / (N_k + n~).
Every one of these queries is logged (:mod:`fedaudit.instruments.queries`): the generator's in its own parameters
(:data:`fedaudit.models.generative.CANARY_PARAMETERS`), the class counts with their metadata only.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from fedaudit.algorithms.base import (
    ClientData,
    ClientMessage,
    RoundContext,
    ServerResult,
    TensorDict,
    clone_params,
    num_classes,
)
from fedaudit.algorithms.fedssyn_settings import generator_records
from fedaudit.config import RunConfig
from fedaudit.instruments.canaries import GRADIENT_CANARY_NORM, canary_directions
from fedaudit.instruments.queries import Space
from fedaudit.models import fresh_params
from fedaudit.models.generative import (
    CANARY_PARAMETERS,
    ConditionalVAE,
    allocate,
    class_counts,
    mean_loss,
    sample,
    train_generator,
)
from fedaudit.privacy.accounting import SGMEvent, round_events
from fedaudit.registry import algorithm as algorithm_entry

SYNTHETIC = "synthetic/"  # prefix of the dealt share in a client's kept state
GENERATION_ROUND = 0


class Fedssyn:
    """Fedssyn: one generation round of shuffled synthetic records, then the inner algorithm on real plus shuffled."""

    name = "fedssyn"
    setup_rounds = 1  # the generation round: every client takes part

    def __init__(self, config: RunConfig | None = None) -> None:
        """The inner algorithm is built from the same configuration."""
        inner = "fedavg" if config is None else config.fedssyn.inner_algorithm
        self.inner = algorithm_entry(inner).build(config)

    def queries_per_round(self, config: RunConfig, num_examples: int) -> int:
        """The inner algorithm's local steps on the client's own records (the generation round is planned apart)."""
        return self.inner.queries_per_round(config, num_examples)

    def privacy_plan(self, config: RunConfig, num_examples: int, round_index: int) -> list[SGMEvent]:
        """The generation round's class counts and generator steps; then the inner algorithm's steps at rate
        B / (N_k + n~)."""
        sigma = config.privacy.noise_multiplier
        fs = config.fedssyn
        if round_index == GENERATION_ROUND:
            m = generator_records(config, num_examples)
            steps = fs.generator_epochs * max(1, m // fs.generator_batch)
            return [
                SGMEvent(noise_multiplier=sigma, sample_rate=1.0, steps=1),
                SGMEvent(noise_multiplier=sigma, sample_rate=fs.generator_batch / m, steps=steps),
            ]
        total = num_examples + fs.synthetic_per_client
        return round_events(
            noise_multiplier=sigma,
            sample_rate=config.federated.batch_size / total,
            queries_per_round=self.queries_per_round(config, num_examples),
        )

    def client_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        state: TensorDict | None = None,
    ) -> ClientMessage:
        """Generation round: train the generator and send generated records. Later rounds: the inner algorithm on
        the client's records plus its dealt share."""
        if ctx.round == GENERATION_ROUND:
            return self._generate(model, global_params, data, ctx, generator)
        state = dict(state or {})
        share = {name: state.pop(name) for name in list(state) if name.startswith(SYNTHETIC)}
        if not share:
            raise RuntimeError(
                f"Client {data.client_id} has no share of the synthetic records in round {ctx.round + 1}."
            )
        x = torch.cat([data.x, share[f"{SYNTHETIC}images"].to(data.x.device, data.x.dtype)])
        y = torch.cat([data.y, share[f"{SYNTHETIC}labels"].to(data.y.device)])
        steps = self.inner.queries_per_round(ctx.config, data.num_examples)
        union = replace(data, x=x, y=y)  # its canaries, query audit and log included
        message = self.inner.client_update(model, global_params, union, self._inner_ctx(ctx, steps), generator, state)
        message.state = {**message.state, **share}
        message.metrics = {**message.metrics, "synthetic_records": float(len(y) - data.num_examples)}
        return message

    def _generate(
        self,
        model: nn.Module,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
    ) -> ClientMessage:
        """Draw rho of the records, count their classes, train the generator on them and generate n~ records."""
        config, fs = ctx.config, ctx.config.fedssyn
        sigma = config.privacy.noise_multiplier if config.privacy.dp else None
        device = data.x.device
        m = generator_records(config, data.num_examples)
        drawn = torch.randperm(data.num_examples, generator=generator, device=generator.device)[:m].to(device)
        x, y = data.x[drawn], data.y[drawn]
        classes = num_classes(model, global_params, data.x)
        log = data.recorder
        if log is not None and data.audit is not None:
            log.enter(None)  # the class counts: metadata only
            log.batch(drawn, data.audit.held, 1.0)  # every record drawn and every canary held is counted
        counted = y if data.canary_y is None else torch.cat([y, data.canary_y])
        source = data.next_query()
        counts, events = class_counts(counted, classes, generator=source, noise_multiplier=sigma, recorder=log)
        vae = ConditionalVAE(tuple(data.x.shape[1:]), classes).to(device)
        with torch.no_grad():
            for name, p in fresh_params(vae, dict(vae.named_parameters()), generator).items():
                vae.get_parameter(name).copy_(p)
        pool = self._generator_pool(vae, replace(data, x=x, y=y), fs.generator_clip)
        steps, metrics = train_generator(
            vae,
            x,
            y,
            epochs=fs.generator_epochs,
            batch_size=fs.generator_batch,
            lr=fs.generator_lr,
            generator=generator,
            noise_multiplier=sigma,
            max_grad_norm=fs.generator_clip,
            draw=pool.dp_batch if sigma is not None else None,
            recorder=log,
        )
        if log is not None and data.audit is not None:
            log.enter(data.audit.space)
        labels = allocate(counts, fs.synthetic_per_client).to(device)
        images = sample(vae, labels, generator).to(data.x.dtype)
        return ClientMessage(
            client_id=data.client_id,
            num_examples=data.num_examples,
            payload={"images": images, "labels": labels},
            metrics={**metrics, "generator_records": float(m), "images_sent": float(len(labels))},
            privacy_events=[*events, *steps],
        )

    @staticmethod
    def _generator_pool(vae: ConditionalVAE, pool: ClientData, clip: float) -> ClientData:
        """The generator's data (its DP batches are drawn from it), in a canary run with the client's canaries:
        input canaries stay records; a gradient canary's gradient becomes 10 ``clip`` u_i, u_i its direction in the
        generator's :data:`CANARY_PARAMETERS`. The log is switched to the generator's space."""
        audit = pool.audit
        if audit is None:
            return pool
        shapes = {name: vae.get_parameter(name).shape for name in CANARY_PARAMETERS}
        device = pool.x.device
        inputs = labels = None
        if audit.inputs is not None and audit.labels is not None:  # input canaries, rows as the generator takes them
            zeros = torch.zeros((len(audit.labels), vae.latent), dtype=audit.inputs.dtype, device=device)
            inputs, labels = vae.pack(audit.inputs.to(device), audit.labels.to(device), zeros), audit.labels
        if pool.recorder is not None:
            pool.recorder.enter(Space(shapes, inputs, labels, mean_loss))
        if pool.canary_grads is None:
            return pool
        directions = canary_directions(audit.seed, audit.held, shapes, device, audit.layout)
        return replace(pool, canary_grads={name: GRADIENT_CANARY_NORM * clip * u for name, u in directions.items()})

    def server_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        messages: list[ClientMessage],
        ctx: RoundContext,
        generator: torch.Generator,
    ) -> ServerResult:
        """Generation round: shuffle every client's generated records and deal equal shares; the model stays.
        Later rounds: the inner algorithm's server update."""
        if ctx.round != GENERATION_ROUND:
            return self.inner.server_update(model, global_params, messages, self._inner_ctx(ctx), generator)
        messages = sorted(messages, key=lambda message: message.client_id)
        images = torch.cat([message.payload["images"].to(ctx.device) for message in messages])
        labels = torch.cat([message.payload["labels"].to(ctx.device) for message in messages])
        order = torch.randperm(len(labels), generator=generator, device=generator.device).to(ctx.device)
        shares = order.split(ctx.config.fedssyn.synthetic_per_client)
        dealt = {
            message.client_id: {f"{SYNTHETIC}images": images[share], f"{SYNTHETIC}labels": labels[share]}
            for message, share in zip(messages, shares)
        }
        return ServerResult(
            params=clone_params(global_params),
            metrics={"synthetic_records": float(len(labels))},
            dealt=dealt,
        )

    @staticmethod
    def _inner_ctx(ctx: RoundContext, steps: int | None = None) -> RoundContext:
        """The inner algorithm's view: its rounds start after the generation round, and a client takes ``steps``
        local steps (those of its own records) whatever the size of its records plus its share."""
        fed = ctx.config.federated
        if steps is not None and fed.local_steps is None:
            ctx = replace(ctx, config=replace(ctx.config, federated=replace(fed, local_steps=steps)))
        return replace(ctx, round=ctx.round - 1, rounds=ctx.rounds - 1)

"""The one DP primitive: per-sample gradients, clipping, Gaussian noise, Poisson sampling.

Every DP query in fedaudit (DP-FedAvg, DP-FedProx, FedLAP-DP's real-gradient
target) goes through :func:`dp_gradient`; the white-box membership attack
uses :func:`per_sample_gradients` and :func:`per_sample_norms` without clipping.
Per-sample gradients come from ``torch.func`` (vmap of grad of
functional_call): no hooks on the module, so the same model can be used in
double-backward code (FedLAP's gradient matching) without interference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

TensorDict = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def trainable_params(model: nn.Module) -> TensorDict:
    """Detached copies of the trainable parameters, keyed by name (the inputs of functional_call)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def per_sample_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    loss_fn: LossFn = F.cross_entropy,
    chunk_size: int | None = None,
) -> TensorDict:
    """Gradient of ``loss_fn(model(x_i), y_i)`` for every example i: each value has shape [B, *param.shape].

    ``params`` defaults to the model's current trainable parameters; buffers are
    taken from the model. ``chunk_size`` bounds the memory of vmap for large batches.
    """
    params = dict(trainable_params(model) if params is None else params)
    buffers = dict(model.named_buffers())

    def sample_loss(p: TensorDict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    if x.shape[0] == 0:
        return {name: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for name, p in params.items()}
    return vmap(grad(sample_loss), in_dims=(None, 0, 0), chunk_size=chunk_size)(params, x, y)


def per_sample_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """L2 norm of each example's gradient over all parameters, shape [B]."""
    squares = [g.flatten(start_dim=1).pow(2).sum(dim=1) for g in grads.values()]
    return torch.stack(squares, dim=0).sum(dim=0).sqrt()


def clip_and_sum(grads: Mapping[str, torch.Tensor], max_grad_norm: float) -> tuple[TensorDict, torch.Tensor]:
    """Scale each example's gradient to norm at most ``max_grad_norm`` and sum over the batch.

    Returns the summed clipped gradients and the unclipped per-sample norms.
    """
    norms = per_sample_norms(grads)
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    summed = {name: torch.einsum("b,b...->...", factors, g) for name, g in grads.items()}
    return summed, norms


def add_noise(
    summed: Mapping[str, torch.Tensor],
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    generator: torch.Generator,
) -> TensorDict:
    """Add one draw of N(0, (noise_multiplier * max_grad_norm)^2 I) to the sum and divide by the expected batch size."""
    std = noise_multiplier * max_grad_norm
    noisy: TensorDict = {}
    for name, s in summed.items():
        noise = torch.normal(0.0, std, size=s.shape, generator=generator, device=s.device, dtype=s.dtype)
        noisy[name] = (s + noise) / expected_batch_size
    return noisy


@dataclass(frozen=True)
class DPGradient:
    """Result of one Sampled Gaussian Mechanism query."""

    grads: TensorDict
    batch_size: int
    per_sample_norms: torch.Tensor


def dp_gradient(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    generator: torch.Generator,
    params: Mapping[str, torch.Tensor] | None = None,
    loss_fn: LossFn = F.cross_entropy,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> DPGradient:
    """The DP gradient of a Poisson-sampled batch: per-sample grads, clip to C, sum, add N(0, sigma^2 C^2), divide by B.

    ``x``/``y`` must be the Poisson sample (see :func:`poisson_sample`); the
    division is by the *expected* batch size so that the batch size itself is
    not revealed. With ``noise_multiplier == 0`` this is the clipped mean
    (no privacy, useful for tests and ablations). Every DP query of fedaudit (DP-FedAvg/FedProx steps, FedLAP-DP's
    real-gradient targets) goes through this one function (docs/algorithms.md).

    Args:
        model: the module whose gradient is taken (its parameters, or ``params`` in their place).
        x, y: the Poisson-sampled batch (possibly empty).
        noise_multiplier: sigma; the noise std is sigma * C.
        max_grad_norm: C, the per-example clipping norm.
        expected_batch_size: B, the divisor of the noisy sum.
        generator: the only source of the noise (one Gaussian draw per parameter tensor).
        params: parameters to differentiate at instead of the module's own.
        loss_fn: per-batch loss, as ``F.cross_entropy``.
        extra: per-example gradients of further sampled records that have no input (gradient canaries), by
            parameter name with a leading batch dimension; clipped, summed and noised with the batch.

    Returns:
        The noisy mean gradient by parameter name, with the per-example norms before clipping.

    Raises:
        ValueError: a non-positive clipping norm or a negative noise multiplier.
    """
    if max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}.")
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be non-negative, got {noise_multiplier}.")
    grads = per_sample_gradients(model, x, y, params=params, loss_fn=loss_fn)
    if extra is not None:
        grads = {name: torch.cat([g, extra[name].to(g.dtype)]) for name, g in grads.items()}
    summed, norms = clip_and_sum(grads, max_grad_norm)
    noisy = add_noise(
        summed,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=expected_batch_size,
        generator=generator,
    )
    return DPGradient(grads=noisy, batch_size=int(x.shape[0]), per_sample_norms=norms)


def poisson_sample(num_records: int, sample_rate: float, *, generator: torch.Generator) -> torch.Tensor:
    """Indices of a Poisson sample: each record is included independently with probability ``sample_rate``."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
    mask = torch.rand(num_records, generator=generator, device=generator.device) < sample_rate
    return torch.nonzero(mask, as_tuple=False).flatten()

"""The one DP primitive: per-sample gradients, clipping, Gaussian noise, Poisson sampling.

Every DP query in fedaudit (DP-FedAvg, DP-FedProx, FedLAP-DP's real-gradient target) goes through
:func:`dp_gradient`, and client-level DP's round through :func:`client_level_mean` (the same clipped sum and noise,
a client's update in place of an example's gradient), or with the noise in shares through each client's
:func:`client_noise_share`; the white-box membership attack uses
:func:`per_sample_sq_norms` without clipping. Both work layer by layer (:mod:`fedaudit.privacy.layers`): one
forward and one backward of the batch, per-sample norms from each layer's inputs and output gradients, and the
clipped sum as each layer's weight gradient with the examples reweighted, so the per-sample gradients of the whole
model never exist at once. The module is only hooked for the duration of one forward pass, and the parameters are
passed functionally, so the same model can be used in double-backward code (FedLAP's gradient matching) without
interference. :func:`per_sample_gradients` (``torch.func``: vmap of grad of functional_call) is the reference and
the path for models the layer-wise one cannot follow.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fedaudit.cuda_graph import GraphedStep, queries_graphed
from fedaudit.privacy.layers import (
    LayerTrace,
    Untraceable,
    layer_sq_norms,
    layer_weighted_sums,
    streamed_chunks,
    trace_layers,
)
from fedaudit.privacy.randomness import Source, add_gaussians, source_device, uniform

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
    frozen: Mapping[str, torch.Tensor] | None = None,
) -> TensorDict:
    """Gradient of ``loss_fn(model(x_i), y_i)`` for every example i: each value has shape [B, *param.shape].

    ``params`` defaults to the model's current trainable parameters; buffers are
    taken from the model. ``frozen`` holds parameters to use as they are, without a gradient (the others of the
    point, when only some are wanted). ``chunk_size`` bounds the memory of vmap for large batches.
    """
    params = dict(trainable_params(model) if params is None else params)
    buffers = {**dict(model.named_buffers()), **{k: v for k, v in (frozen or {}).items() if k not in params}}

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

    An example whose gradient is not finite (it overflowed) is scaled to zero: it adds nothing, so the sum's
    sensitivity stays ``max_grad_norm`` (a NaN would otherwise make the whole sum NaN, and reveal the example).
    Returns the summed clipped gradients and the unclipped per-sample norms.
    """
    norms = per_sample_norms(grads)
    finite = torch.isfinite(norms)
    factors = torch.where(finite, _clip_factors(norms, max_grad_norm), 0.0)
    summed = {
        name: torch.einsum("b,b...->...", factors, torch.where(finite.view(-1, *[1] * (g.dim() - 1)), g, 0.0))
        for name, g in grads.items()
    }
    return summed, norms


def per_sample_sq_norms(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    loss_fn: LossFn = F.cross_entropy,
) -> TensorDict:
    """Squared norm of every example's gradient of each parameter, shape [B] each, without clipping.

    Equal to ``g.flatten(1).pow(2).sum(1)`` of :func:`per_sample_gradients` up to float rounding. ``loss_fn`` is a
    mean over examples (as ``F.cross_entropy``).
    """
    params = dict(trainable_params(model) if params is None else params)
    if x.shape[0] == 0:
        return {name: torch.zeros(0, dtype=p.dtype, device=p.device) for name, p in params.items()}
    traced = _layer_squares(model, x, y, params, loss_fn, for_sum=False)
    if traced is None:
        grads = per_sample_gradients(model, x, y, params=params, loss_fn=loss_fn)
        return {name: g.flatten(start_dim=1).pow(2).sum(dim=1) for name, g in grads.items()}
    return traced[1]


def _layer_squares(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    loss_fn: LossFn,
    *,
    for_sum: bool,
) -> tuple[list[LayerTrace], TensorDict] | None:
    """The batch's layer traces and per-parameter squared per-sample norms (in the order of ``params``), or None
    for a model the layer-wise path cannot follow (the caller then takes the whole-model vmap path)."""
    squares: TensorDict = {}

    def visit(layer: LayerTrace) -> None:
        squares.update(layer_sq_norms(layer, params, for_sum=for_sum))

    try:
        traces = trace_layers(model, x, y, params, loss_fn, visit)
    except Untraceable:
        return None
    return traces, {name: squares[name] for name in params if name in squares}  # streamed weights come later


def clipped_sum(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    max_grad_norm: float,
    *,
    params: Mapping[str, torch.Tensor] | None = None,
    loss_fn: LossFn = F.cross_entropy,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> tuple[TensorDict, torch.Tensor]:
    """:func:`clip_and_sum` of the batch's per-sample gradients (and of ``extra``'s), computed layer by layer.

    Returns the sum of the clipped gradients by parameter name (in the order of ``params``) and the per-example
    norms before clipping (the batch's, then ``extra``'s). An example whose gradient overflowed adds nothing.
    """
    params = dict(trainable_params(model) if params is None else params)
    if x.shape[0] == 0:
        summed = {name: torch.zeros_like(p) for name, p in params.items()}
        norms = torch.zeros(0, dtype=next(iter(params.values())).dtype, device=x.device)
    else:
        traced = _layer_squares(model, x, y, params, loss_fn, for_sum=True)
        if traced is None:
            grads = per_sample_gradients(model, x, y, params=params, loss_fn=loss_fn)
            summed, norms = clip_and_sum(grads, max_grad_norm)
        else:
            traces, squares = traced
            total = (
                torch.stack(list(squares.values())).sum(0)
                if squares
                else torch.zeros(x.shape[0], dtype=next(iter(params.values())).dtype, device=x.device)
            )
            streamed = [layer for layer in traces if layer.streamed]
            parts = _streamed_sums(streamed, total, max_grad_norm) if streamed else {}
            norms = total.sqrt()
            finite = torch.isfinite(norms)
            if not bool(finite.all()):  # see clip_and_sum: overflowed examples add nothing (their inputs, too, are
                # left out, since a layer's weighted sum would multiply their infinities by a zero factor)
                summed = clipped_sum(model, x[finite], y[finite], max_grad_norm, params=params, loss_fn=loss_fn)[0]
                return _with_extra(summed, norms, extra, max_grad_norm)
            factors = _clip_factors(norms, max_grad_norm)
            for layer in traces:
                if not layer.streamed:
                    parts.update(layer_weighted_sums(layer, factors))
            summed = {name: parts[name] for name in params}
    return _with_extra(summed, norms, extra, max_grad_norm)


def padded_clipped_sum(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    real: torch.Tensor,
    max_grad_norm: float,
    *,
    params: Mapping[str, torch.Tensor],
    loss_fn: LossFn = F.cross_entropy,
) -> tuple[TensorDict, torch.Tensor, torch.Tensor] | None:
    """:func:`clipped_sum` of the rows where ``real`` is true, on a batch padded with other rows: the sum, every
    row's norm, and whether any row's gradient overflowed (then the sum is not valid: take :func:`clipped_sum` of
    the real rows). It branches on no tensor's value, so on CUDA it can be captured as a graph for a fixed padded
    size. A padded row changes no real row's output gradient (each example's loss touches its own row, and the
    layer-wise path follows only models whose layers work example by example) and enters the sums with factor 0
    (an overflowed one would make them NaN: hence the flag covers it too). None where the layer-wise path cannot
    follow the model or streams a layer (its chunks read norms back)."""
    traced = _layer_squares(model, x, y, params, loss_fn, for_sum=True)
    if traced is None or not traced[1] or any(layer.streamed for layer in traced[0]):
        return None
    traces, squares = traced
    norms = torch.stack(list(squares.values())).sum(0).sqrt()
    overflowed = ~torch.isfinite(norms).all()
    factors = torch.where(real, _clip_factors(norms, max_grad_norm), 0.0)
    parts: TensorDict = {}
    for layer in traces:
        parts.update(layer_weighted_sums(layer, factors))
    return {name: parts[name] for name in params}, norms, overflowed


def padded_size(expected_batch_size: float) -> int:
    """The rows of a padded Poisson batch: B + 6 sqrt(B), rounded up to a multiple of 8. A Poisson batch of mean B
    (variance at most B) is larger about once in 10^9 steps; that step is taken unpadded."""
    return 8 * math.ceil((expected_batch_size + 6 * math.sqrt(expected_batch_size)) / 8)


_CAPTURED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, GraphedStep | None]] = weakref.WeakKeyDictionary()
"""Each model's captured padded queries, by padded size, input shape, dtype, parameter names, clipping norm and loss
(None where the model cannot be captured)."""


def _captured_clipped_sum(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    max_grad_norm: float,
    *,
    params: Mapping[str, torch.Tensor],
    loss_fn: LossFn,
    expected_batch_size: float,
) -> tuple[TensorDict, torch.Tensor] | None:
    """:func:`clipped_sum`'s result from a CUDA graph of :func:`padded_clipped_sum` (FEDAUDIT_CUDA_GRAPHS=all), or
    None where it does not apply: the caller then computes :func:`clipped_sum`. The batch and the parameters are
    copied into the graph's inputs; the sums returned are the graph's own, valid until the model's next query."""
    size, n = padded_size(expected_batch_size), x.shape[0]
    if not queries_graphed(x.device) or n == 0 or n > size:
        return None
    shapes = (tuple(x.shape[1:]), x.dtype, tuple(y.shape[1:]), y.dtype, x.device)
    key = (size, *shapes, tuple(params), float(max_grad_norm), loss_fn)
    captured = _CAPTURED.setdefault(model, {})
    if key not in captured:
        owner = weakref.ref(model)  # the model keys the cache: the query must not keep it alive

        def query(batch: list[torch.Tensor], point: TensorDict) -> tuple[TensorDict, torch.Tensor, torch.Tensor] | None:
            rows, labels, real = batch
            model = owner()
            assert model is not None  # a query runs while its model is being queried
            return padded_clipped_sum(model, rows, labels, real, max_grad_norm, params=point, loss_fn=loss_fn)

        captured[key] = GraphedStep(query, copy_outputs=False)
    step = captured[key]
    if step is None:
        return None
    pad = size - n
    batch = [
        torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]),
        torch.cat([y, y.new_zeros((pad, *y.shape[1:]))]),
        torch.arange(size, device=x.device) < n,
    ]
    result = step(batch, dict(params))
    if result is None or step.failed:  # not capturable: the eager query on the real rows from now on
        captured[key] = None
        return None if result is None else _unpadded(result, n)
    return _unpadded(result, n)


def _unpadded(result: tuple[TensorDict, torch.Tensor, torch.Tensor], n: int) -> tuple[TensorDict, torch.Tensor] | None:
    """The padded query's sum and its ``n`` real rows' norms, or None where a row overflowed (the caller then takes
    the eager query of the real rows)."""
    summed, norms, overflowed = result
    if bool(overflowed):
        return None
    return summed, norms[:n].clone()


def _clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """min(1, C / ||g_i||) for every example (the 1e-6 keeps a zero gradient's factor finite)."""
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


def _streamed_sums(streamed: list[LayerTrace], total: torch.Tensor, max_grad_norm: float) -> TensorDict:
    """The streamed layers' clipped sums, chunk by chunk of examples: each chunk's per-sample gradients are
    added to ``total`` (the batch's squared norms so far, completed in place) and weighed by the chunk's clip
    factors at once. A chunk with an overflowed example adds nothing (the caller then sums again without it)."""
    parts: TensorDict = {}
    for start, stop, chunk in streamed_chunks(streamed):
        for layer in chunk:
            total[start:stop] += torch.linalg.vector_norm(layer.kept[0]["weight"].flatten(1), dim=1).pow(2)
        norms = total[start:stop].sqrt()
        if not bool(torch.isfinite(norms).all()):
            continue
        factors = _clip_factors(norms, max_grad_norm)
        for layer in chunk:
            for name, part in layer_weighted_sums(layer, factors).items():
                parts[name] = parts[name] + part if name in parts else part
    return parts


def _with_extra(
    summed: TensorDict, norms: torch.Tensor, extra: Mapping[str, torch.Tensor] | None, max_grad_norm: float
) -> tuple[TensorDict, torch.Tensor]:
    """``summed`` plus the clipped sum of ``extra``'s per-example gradients, and ``norms`` followed by theirs. A
    parameter that ``extra`` leaves out is one its gradients are zero in."""
    if extra is None or len(next(iter(extra.values()))) == 0:
        return summed, norms
    extra_summed, extra_norms = clip_and_sum(
        {name: extra[name].to(summed[name].dtype) for name in summed if name in extra}, max_grad_norm
    )
    total = {name: summed[name] + extra_summed[name] if name in extra_summed else summed[name] for name in summed}
    return total, torch.cat([norms, extra_norms.to(norms.dtype)])


def add_noise(
    summed: Mapping[str, torch.Tensor],
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    generator: Source,
) -> TensorDict:
    """Add one draw of N(0, (noise_multiplier * max_grad_norm)^2 I) to the sum and divide by the expected batch size."""
    released = noisy_sum(summed, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, generator=generator)
    return {name: s / expected_batch_size for name, s in released.items()}


def noisy_sum(
    summed: Mapping[str, torch.Tensor], *, noise_multiplier: float, max_grad_norm: float, generator: Source
) -> TensorDict:
    """The sum plus one draw of N(0, (noise_multiplier * max_grad_norm)^2 I): the released value of the query.

    One draw per tensor, in the order of ``summed``, from the query's own source (a torch generator, or a secure
    stream: :mod:`fedaudit.privacy.randomness`)."""
    released = add_gaussians(list(summed.values()), noise_multiplier * max_grad_norm, generator)
    return dict(zip(summed, released))


def client_level_mean(
    updates: list[Mapping[str, torch.Tensor]],
    like: Mapping[str, torch.Tensor],
    *,
    max_update_norm: float,
    noise_multiplier: float,
    expected_clients: float,
    generator: Source,
) -> tuple[TensorDict, torch.Tensor]:
    """Client-level DP's release of a round: the same query as a DP-SGD step's, with a client's whole model update
    in place of an example's gradient. Each update clipped to ``max_update_norm`` C (an update that is not finite to
    zero), the clipped updates summed, one draw of N(0, (sigma C)^2 I) added from the server's source, and the sum
    divided by the expected number of clients q K (the fixed denominator, so that one client changes the release by
    at most C / (q K)). ``like`` gives the names and shapes when no client was sampled (the release is then the
    noise alone). Returns the released mean update and the updates' norms before clipping."""
    stacked = {
        name: torch.stack([update[name] for update in updates]) if updates else p.new_zeros((0, *p.shape))
        for name, p in like.items()
    }
    summed, norms = clip_and_sum(stacked, max_update_norm)
    released = add_noise(
        summed,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_update_norm,
        expected_batch_size=expected_clients,
        generator=generator,
    )
    return released, norms


def client_noise_share(
    update: Mapping[str, torch.Tensor],
    *,
    max_update_norm: float,
    noise_multiplier: float,
    participants: int,
    generator: Source,
) -> tuple[TensorDict, torch.Tensor]:
    """A client's part of client-level DP with the noise in shares (``--noise-at clients``): its model update clipped
    to ``max_update_norm`` C (not finite: zero) plus one draw of N(0, (sigma C)^2 / m I) from the client's own
    source, m the round's ``participants``, so that the sum of the m shares is the clipped sum plus N(0, (sigma C)^2
    I), the release of :func:`client_level_mean` times q K. Returns the share and the update's norm before
    clipping."""
    if participants < 1:
        raise ValueError(f"a noise share needs the round's number of clients, got {participants}.")
    summed, norms = clip_and_sum({name: u.unsqueeze(0) for name, u in update.items()}, max_update_norm)
    share = noisy_sum(
        summed,
        noise_multiplier=noise_multiplier / math.sqrt(participants),
        max_grad_norm=max_update_norm,
        generator=generator,
    )
    return share, norms[0]


@dataclass(frozen=True)
class Query:
    """One answered Sampled Gaussian Mechanism query, as the primitive released it (for a query recorder).

    ``released`` is the noisy clipped sum S + N before the division by B, in the order of ``params``: what an
    auditor who sees every noisy query observes. ``own_sum`` is the part of S that the client's own records drew
    (an auditor who knows every record but the canaries' membership, and the records' batch, can compute it).
    ``params`` is the point the gradients were taken at.
    """

    released: TensorDict
    own_sum: TensorDict  # the clean clipped sum of the client's own records drawn (canaries excluded)
    params: TensorDict
    x: torch.Tensor  # the batch's inputs as the gradients saw them (after any augmentation)
    y: torch.Tensor
    batch_size: int  # records in the batch, extra (gradient canaries) included
    noise_multiplier: float
    max_grad_norm: float
    expected_batch_size: float
    model: nn.Module | None = None  # the module the gradients were taken of (at ``params``)


class QueryRecorder(Protocol):
    """Something that wants to see every query the primitive answers (an audit's tap); it must not change them."""

    def own_rows(self) -> int:
        """How many leading rows of the next query's inputs are the client's own records (the rest are canaries)."""

    def record(self, query: Query) -> None:
        """Take note of one answered query."""


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
    generator: Source,
    params: Mapping[str, torch.Tensor] | None = None,
    loss_fn: LossFn = F.cross_entropy,
    extra: Mapping[str, torch.Tensor] | None = None,
    recorder: QueryRecorder | None = None,
) -> DPGradient:
    """The DP gradient of a Poisson-sampled batch: per-sample grads, clip to C, sum, add N(0, sigma^2 C^2), divide by B.

    ``x``/``y`` must be the Poisson sample (see :func:`poisson_sample`); the
    division is by the *expected* batch size so that the batch size itself is
    not revealed. With ``noise_multiplier == 0`` this is the clipped mean
    (no privacy, useful for tests and ablations). The clipped sum is computed layer by layer
    (:func:`clipped_sum`). Every DP query of fedaudit (DP-FedAvg/FedProx steps, FedLAP-DP's
    real-gradient targets) goes through this one function (docs/algorithms.md).

    Args:
        model: the module whose gradient is taken (its parameters, or ``params`` in their place).
        x, y: the Poisson-sampled batch (possibly empty).
        noise_multiplier: sigma; the noise std is sigma * C.
        max_grad_norm: C, the per-example clipping norm.
        expected_batch_size: B, the divisor of the noisy sum.
        generator: the only source of the noise (one Gaussian draw per parameter tensor): the query's own generator
            or secure stream, derived from the client's secret (:class:`fedaudit.privacy.randomness.QueryDraws`).
        params: parameters to differentiate at instead of the module's own.
        loss_fn: the batch loss, a mean over examples as ``F.cross_entropy``.
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
    params = dict(trainable_params(model) if params is None else params)
    captured = None
    if extra is None and recorder is None:  # canaries and the query log take the eager query
        captured = _captured_clipped_sum(
            model, x, y, max_grad_norm, params=params, loss_fn=loss_fn, expected_batch_size=expected_batch_size
        )
    summed, norms = captured or clipped_sum(model, x, y, max_grad_norm, params=params, loss_fn=loss_fn)
    own_sum = summed
    summed, norms = _with_extra(summed, norms, extra, max_grad_norm)
    released = noisy_sum(summed, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, generator=generator)
    noisy = dict(zip(released, torch._foreach_div(list(released.values()), expected_batch_size)))  # one launch
    if recorder is not None:
        own = recorder.own_rows()
        if own < x.shape[0]:
            own_sum = clipped_sum(model, x[:own], y[:own], max_grad_norm, params=params, loss_fn=loss_fn)[0]
        recorder.record(
            Query(
                released=released,
                own_sum=own_sum,
                params=params,
                x=x,
                y=y,
                batch_size=int(norms.shape[0]),
                noise_multiplier=noise_multiplier,
                max_grad_norm=max_grad_norm,
                expected_batch_size=expected_batch_size,
                model=model,
            )
        )
    return DPGradient(grads=noisy, batch_size=int(x.shape[0]), per_sample_norms=norms)


def poisson_sample(num_records: int, sample_rate: float, *, generator: Source) -> torch.Tensor:
    """Indices of a Poisson sample: each record is included independently with probability ``sample_rate`` (one
    uniform per record from ``generator``, on its device)."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
    mask = uniform(generator, num_records) < sample_rate
    return torch.nonzero(mask, as_tuple=False).flatten().to(source_device(generator))

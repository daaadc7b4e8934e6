"""The DP primitive against independent references: a slow per-example loop, Opacus, statistics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import loop_grads
from opacus import GradSampleModule

from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy.primitive import (
    add_noise,
    clip_and_sum,
    dp_gradient,
    per_sample_gradients,
    per_sample_norms,
    poisson_sample,
)

SPECS = {
    "convnet": ModelSpec("convnet", (1, 16, 16), 10, width=8, depth=2),
    "convnet-rgb": ModelSpec("convnet", (3, 8, 8), 4, width=6, depth=3),
    "mlp": ModelSpec("mlp", (1, 8, 8), 10, width=16, depth=2),
}


def _model_and_batch(name: str, batch: int = 7, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    spec = SPECS[name]
    model = build_model(spec).double()
    x = torch.randn(batch, *spec.input_shape, dtype=torch.float64)
    y = torch.randint(0, spec.num_classes, (batch,))
    return model, x, y


@pytest.mark.parametrize("name", sorted(SPECS))
def test_per_sample_gradients_match_slow_loop(name: str) -> None:
    model, x, y = _model_and_batch(name)
    ours = per_sample_gradients(model, x, y)
    reference = loop_grads(model, x, y)
    assert ours.keys() == reference.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_per_sample_gradients_match_opacus(name: str) -> None:
    model, x, y = _model_and_batch(name, batch=9, seed=1)
    ours = per_sample_gradients(model, x, y)
    gsm = GradSampleModule(model, loss_reduction="sum")
    # Opacus' grad samples are of the summed loss, which equals per-example loss gradients.
    F.cross_entropy(gsm(x.requires_grad_(True)), y, reduction="sum").backward()
    for pname, p in model.named_parameters():
        torch.testing.assert_close(ours[pname], p.grad_sample, rtol=1e-9, atol=1e-12)
    gsm._close()


def test_clipping_bounds_every_norm_and_keeps_small_gradients() -> None:
    model, x, y = _model_and_batch("convnet", batch=16)
    grads = per_sample_gradients(model, x, y)
    norms = per_sample_norms(grads)
    clip = float(norms.median())
    summed, returned_norms = clip_and_sum(grads, clip)
    torch.testing.assert_close(returned_norms, norms)
    factors = torch.clamp(clip / (norms + 1e-6), max=1.0)
    clipped = {k: g * factors.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}
    clipped_norms = per_sample_norms(clipped)
    assert float(clipped_norms.max()) <= clip * (1 + 1e-9)
    # examples under the bound are untouched; the sum is the sum of clipped gradients
    small = norms < clip
    torch.testing.assert_close(clipped_norms[small], norms[small])
    for key in summed:
        torch.testing.assert_close(summed[key], clipped[key].sum(0))


def test_dp_gradient_without_noise_is_bounded_by_clip_norm() -> None:
    model, x, y = _model_and_batch("mlp", batch=32)
    generator = torch.Generator().manual_seed(0)
    result = dp_gradient(
        model, x, y, noise_multiplier=0.0, max_grad_norm=1e-3, expected_batch_size=32, generator=generator
    )
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in result.grads.values()))
    assert total <= 1e-3 * (1 + 1e-6)
    assert result.batch_size == 32


def test_noise_standard_deviation_is_sigma_c_over_b() -> None:
    sigma, clip, batch = 1.3, 0.7, 50.0
    zeros = {"w": torch.zeros(200_000, dtype=torch.float64)}
    generator = torch.Generator().manual_seed(123)
    noisy = add_noise(
        zeros, noise_multiplier=sigma, max_grad_norm=clip, expected_batch_size=batch, generator=generator
    )["w"]
    expected = sigma * clip / batch
    # the sample std of n Gaussians has relative standard error ~ 1/sqrt(2n) = 0.0016; allow 5 of them
    assert abs(float(noisy.std()) / expected - 1.0) < 0.008
    assert abs(float(noisy.mean())) < 5 * expected / math.sqrt(zeros["w"].numel())


def test_noise_is_added_once_to_the_sum() -> None:
    """Same generator state gives the same noise; the noisy mean minus the clipped mean is exactly noise / B."""
    model, x, y = _model_and_batch("mlp", batch=8)
    a = dp_gradient(
        model,
        x,
        y,
        noise_multiplier=2.0,
        max_grad_norm=0.5,
        expected_batch_size=10,
        generator=torch.Generator().manual_seed(5),
    )
    clean = dp_gradient(
        model,
        x,
        y,
        noise_multiplier=0.0,
        max_grad_norm=0.5,
        expected_batch_size=10,
        generator=torch.Generator().manual_seed(5),
    )
    # regenerate the noise the way dp_gradient draws it: one draw per parameter, in order, from one generator
    generator = torch.Generator().manual_seed(5)
    for key, value in clean.grads.items():
        draw = torch.normal(0.0, 2.0 * 0.5, size=value.shape, generator=generator, dtype=value.dtype)
        torch.testing.assert_close(a.grads[key] - value, draw / 10)


def test_poisson_batch_sizes_have_the_right_mean_and_variance() -> None:
    n, q, trials = 1000, 0.05, 2000
    generator = torch.Generator().manual_seed(7)
    sizes = torch.tensor([len(poisson_sample(n, q, generator=generator)) for _ in range(trials)], dtype=torch.float64)
    mean_se = math.sqrt(n * q * (1 - q) / trials)
    assert abs(float(sizes.mean()) - n * q) < 5 * mean_se
    assert abs(float(sizes.var()) / (n * q * (1 - q)) - 1) < 0.15
    sample = poisson_sample(n, q, generator=generator)
    assert sample.unique().numel() == sample.numel() and int(sample.max()) < n


def test_empty_poisson_batch_gives_pure_noise() -> None:
    model, x, y = _model_and_batch("mlp", batch=4)
    result = dp_gradient(
        model,
        x[:0],
        y[:0],
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4,
        generator=torch.Generator().manual_seed(0),
    )
    assert result.batch_size == 0
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in result.grads.values())

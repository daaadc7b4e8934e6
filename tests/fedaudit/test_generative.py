"""Fedssyn's generator: the class counts through the DP primitive, the labels' allocation, the per-record loss the
DP primitive clips, and a generator that learns what each class looks like."""

from __future__ import annotations

import pytest
import torch
from helpers import with_keys

from fedaudit.algorithms.base import ClientData
from fedaudit.models.generative import ConditionalVAE, allocate, class_counts, mean_loss, sample, train_generator
from fedaudit.privacy.primitive import dp_gradient, per_sample_gradients
from fedaudit.privacy.randomness import SeededKeys


def test_class_counts_are_exact_without_noise_and_gaussian_with_it() -> None:
    y = torch.tensor([0, 2, 2, 3, 3, 3])
    counts, events = class_counts(y, 5, generator=torch.Generator().manual_seed(0))
    assert counts.tolist() == [1, 0, 2, 3, 0] and events == []
    draws = torch.stack(
        [class_counts(y, 5, generator=torch.Generator().manual_seed(s), noise_multiplier=2.0)[0] for s in range(4000)]
    )
    assert torch.allclose(draws.mean(0), torch.tensor([1.0, 0, 2, 3, 0], dtype=torch.float64), atol=0.15)
    assert torch.allclose(draws.std(0), torch.full((5,), 2.0, dtype=torch.float64), rtol=0.05)  # sigma * norm 1
    _, events = class_counts(y, 5, generator=torch.Generator(), noise_multiplier=2.0)
    assert [(e.noise_multiplier, e.sample_rate, e.steps) for e in events] == [(2.0, 1.0, 1)]


@pytest.mark.parametrize(
    ("counts", "total", "expected"),
    [
        ([3.0, 1.0], 8, [6, 2]),
        ([1.0, 1.0, 1.0], 4, [2, 1, 1]),  # the remainder goes to the lower class on ties
        ([-2.0, 5.0, 0.4], 10, [0, 9, 1]),  # a noisy negative count is zero
        ([-1.0, -3.0], 5, [3, 2]),  # no positive count: uniform
    ],
)
def test_labels_follow_the_counts_by_largest_remainder(counts, total, expected) -> None:
    labels = allocate(torch.tensor(counts, dtype=torch.float64), total)
    assert torch.bincount(labels, minlength=len(counts)).tolist() == expected
    assert labels.tolist() == sorted(labels.tolist())


def test_the_dp_sum_of_the_generator_is_the_clipped_sum_of_each_records_own_gradient() -> None:
    """Each row's loss depends on its own record and latent noise only: the layer-wise clipped sum equals the
    per-example loop (vmap of the row's own gradient), so the DP primitive clips what one record contributes."""
    torch.manual_seed(0)
    vae = ConditionalVAE((1, 4, 4), 3, hidden=8, latent=2).double()
    x, y = torch.randn(6, 1, 4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    packed = vae.pack(x, y, torch.randn(6, 2, dtype=torch.float64))
    clip = 0.5
    result = dp_gradient(
        vae,
        packed,
        y,
        noise_multiplier=0.0,
        max_grad_norm=clip,
        expected_batch_size=1.0,
        generator=torch.Generator(),
        loss_fn=mean_loss,
    )
    grads = per_sample_gradients(vae, packed, y, loss_fn=mean_loss)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    factors = (clip / (norms + 1e-6)).clamp(max=1.0)
    for name, g in grads.items():
        assert torch.allclose(result.grads[name], torch.einsum("b,b...->...", factors, g), atol=1e-10)
    assert (norms > clip).all()  # the clipping acted


def test_generated_records_look_like_their_class() -> None:
    """Two well-separated classes: every generated record is nearer its own class's real mean than the other's;
    with the labels hidden from the generator (a planted fault) about half are."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.zeros(2, 1, 4, 4)
    centres[0, 0, :2], centres[1, 0, 2:] = 2.0, 2.0
    y = torch.arange(2).repeat(200)
    x = centres[y] + 0.3 * torch.randn(400, 1, 4, 4, generator=generator)

    def nearest_mean_accuracy(train_labels: torch.Tensor) -> float:
        vae = ConditionalVAE((1, 4, 4), 2, hidden=32, latent=2)
        train_generator(vae, x, train_labels, epochs=40, batch_size=32, lr=3e-3, generator=generator)
        labels = torch.arange(2).repeat(100)
        images = sample(vae, labels, generator)
        distances = torch.cdist(images.flatten(1), centres.flatten(1))
        return float((distances.argmin(1) == labels).float().mean())

    assert nearest_mean_accuracy(y) > 0.95
    assert nearest_mean_accuracy(torch.zeros_like(y)) < 0.7


def test_dp_training_reports_its_steps_and_rate_and_no_loss() -> None:
    vae = ConditionalVAE((1, 2, 2), 2, hidden=4, latent=2)
    x, y = torch.randn(50, 1, 2, 2), torch.arange(2).repeat(25)
    data = with_keys(ClientData(0, x, y), SeededKeys(0, 0))
    events, metrics = train_generator(
        vae,
        x,
        y,
        epochs=3,
        batch_size=10,
        lr=1e-3,
        generator=torch.Generator(),
        noise_multiplier=1.5,
        draw=data.dp_batch,
    )
    assert [(e.noise_multiplier, e.sample_rate, e.steps) for e in events] == [(1.5, 0.2, 15)]
    assert data.draws.made == 15  # each step a DP query of its own, batch and noise from its own source
    with pytest.raises(ValueError, match="source"):
        train_generator(vae, x, y, epochs=1, batch_size=10, lr=1e-3, generator=torch.Generator(), noise_multiplier=1.5)
    assert metrics == {}  # a loss on the real batches, without noise, would tell of the records
    _, plain = train_generator(vae, x, y, epochs=1, batch_size=10, lr=1e-3, generator=torch.Generator())
    assert set(plain) == {"generator_loss_first", "generator_loss_last"}

"""Differentiable siamese augmentation (DSA) for gradient matching.

The same seed gives the same transformation, so a real batch and the
synthetic batch matched against it are augmented identically whatever their
sizes: as in siamese DSA (Zhao and Bilen, ICML 2021, the authors' code), one
parameter set is drawn per operation and shared by every image of the batch
(color, crop, cutout, flip, scale and rotate).
Every operation is differentiable in the images, so the synthetic images can
be optimised through it. The seed comes from the run's derived generators,
never from the clock, so runs stay reproducible.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

STRATEGY = ("color", "crop", "cutout", "flip", "scale", "rotate")


# Parameters are drawn once per operation and broadcast over the batch (siamese augmentation).
_DRAWS = 1


def augment(x: torch.Tensor, *, seed: int, strategy: tuple[str, ...] = STRATEGY) -> torch.Tensor:
    """Apply the DSA operations in ``strategy`` to a batch [B, C, H, W], with one parameter set drawn from ``seed``
    shared by the whole batch."""
    generator = torch.Generator(device=x.device)
    generator.manual_seed(seed)
    for name in strategy:
        x = _OPS[name](x, generator)
    return x


def _uniform(generator: torch.Generator, n: int, low: float, high: float, device: torch.device) -> torch.Tensor:
    return torch.rand(n, generator=generator, device=device) * (high - low) + low


def _color(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    n = _DRAWS
    brightness = _uniform(generator, n, -0.5, 0.5, x.device).view(-1, 1, 1, 1)
    x = x + brightness
    if x.shape[1] > 1:
        saturation = _uniform(generator, n, 0.0, 2.0, x.device).view(-1, 1, 1, 1)
        mean = x.mean(dim=1, keepdim=True)
        x = (x - mean) * saturation + mean
    contrast = _uniform(generator, n, 0.5, 1.5, x.device).view(-1, 1, 1, 1)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return (x - mean) * contrast + mean


def _affine(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    grid = F.affine_grid(theta, list(x.shape), align_corners=True)
    return F.grid_sample(x, grid, align_corners=True)


def _scale(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    sx = _uniform(generator, _DRAWS, 0.8, 1.2, x.device)
    sy = _uniform(generator, _DRAWS, 0.8, 1.2, x.device)
    theta = torch.zeros(x.shape[0], 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 1, 1] = sx, sy
    return _affine(x, theta)


def _rotate(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    angle = _uniform(generator, _DRAWS, -15.0, 15.0, x.device) * math.pi / 180.0
    theta = torch.zeros(x.shape[0], 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 0, 1] = torch.cos(angle), -torch.sin(angle)
    theta[:, 1, 0], theta[:, 1, 1] = torch.sin(angle), torch.cos(angle)
    return _affine(x, theta)


def _flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    flip = (torch.rand(_DRAWS, generator=generator, device=x.device) < 0.5).view(-1, 1, 1, 1)
    return torch.where(flip, x.flip(3), x)


def _crop(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Translate by up to 1/8 of the image size with zero padding (a differentiable random crop)."""
    n, _, h, w = x.shape
    shift_x = (
        (torch.randint(-(w // 8), w // 8 + 1, (_DRAWS,), generator=generator, device=x.device).to(x.dtype))
        * 2
        / max(w - 1, 1)
    )
    shift_y = (
        (torch.randint(-(h // 8), h // 8 + 1, (_DRAWS,), generator=generator, device=x.device).to(x.dtype))
        * 2
        / max(h - 1, 1)
    )
    theta = torch.zeros(n, 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0], theta[:, 1, 1] = 1.0, 1.0
    theta[:, 0, 2], theta[:, 1, 2] = shift_x, shift_y
    return _affine(x, theta)


def _cutout(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Zero a square of half the image size centred at a random position (clipped at the borders)."""
    n, _, h, w = x.shape
    size_h, size_w = max(1, h // 2), max(1, w // 2)
    cy = torch.randint(0, h, (_DRAWS, 1, 1), generator=generator, device=x.device)
    cx = torch.randint(0, w, (_DRAWS, 1, 1), generator=generator, device=x.device)
    rows = torch.arange(h, device=x.device).view(1, h, 1) - (cy - size_h // 2)
    cols = torch.arange(w, device=x.device).view(1, 1, w) - (cx - size_w // 2)
    inside = (rows >= 0) & (rows < size_h) & (cols >= 0) & (cols < size_w)
    return x * (~inside).unsqueeze(1).to(x.dtype)


_OPS = {"color": _color, "crop": _crop, "cutout": _cutout, "flip": _flip, "scale": _scale, "rotate": _rotate}

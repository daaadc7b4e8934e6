"""How close a reconstructed image is to a real record: PSNR and SSIM (scikit-image), matched pairs, intervals.

Images are compared in pixel space, [0, 1] per channel: a dataset's standardised values are mapped back through its
training split's per-channel minimum and maximum (for the built-in datasets, the pixels 0 and 1 of the raw images).
PSNR and SSIM are scikit-image's (``skimage.metrics``), with a data range of 1; an exact copy has an infinite PSNR,
which summaries count as :data:`PSNR_CAP` so that a mean stays finite. LPIPS is left out: it needs network weights
downloaded from elsewhere. Every summary carries its 95% interval over records and its n.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from scipy.stats import t as student_t
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from fedaudit.attacks.metrics import CONFIDENCE, rate_interval

PSNR_CAP = 100.0  # dB: what an exact copy (infinite PSNR) counts as in a mean
SSIM_WINDOW = 7  # scikit-image's default side of the SSIM window; smaller images get the largest odd side they hold
MIN_SSIM_SIDE = 3  # the smallest window SSIM has


def pixel_range(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel minimum and maximum of a set of images [N, C, H, W] (a dataset's training split): the values that
    map to 0 and 1 in pixel space, and the box a reconstruction is kept in."""
    return images.amin(dim=(0, 2, 3)), images.amax(dim=(0, 2, 3))


def to_pixels(images: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> np.ndarray:
    """Standardised images [N, C, H, W] in pixel space [0, 1] (float64), clipped to it."""
    shape = (1, -1, 1, 1)
    span = (high - low).clamp(min=1e-12).view(shape)
    scaled = (images.detach().to("cpu", torch.float64) - low.double().view(shape)) / span.double()
    return scaled.clamp(0.0, 1.0).numpy()


def ssim_window(height: int, width: int) -> int | None:
    """The SSIM window for images of this size: scikit-image's 7, or the largest odd side that fits (None when not
    even a 3x3 window fits)."""
    side = min(SSIM_WINDOW, height, width)
    side -= 1 - side % 2
    return side if side >= MIN_SSIM_SIDE else None


def psnr(real: np.ndarray, guess: np.ndarray) -> float:
    """PSNR in dB of one image against the real one ([C, H, W] in [0, 1]); infinite for an exact copy."""
    if np.array_equal(real, guess):
        return math.inf
    return float(peak_signal_noise_ratio(real, guess, data_range=1.0))


def ssim(real: np.ndarray, guess: np.ndarray) -> float:
    """SSIM of one image against the real one ([C, H, W] in [0, 1]), scikit-image's Gaussian-free default (a uniform
    7x7 window, or the largest odd window the image holds)."""
    window = ssim_window(real.shape[1], real.shape[2])
    if window is None:
        raise ValueError(f"SSIM needs images of at least {MIN_SSIM_SIDE}x{MIN_SSIM_SIDE} pixels, got {real.shape}.")
    if real.shape[0] == 1:
        return float(structural_similarity(real[0], guess[0], data_range=1.0, win_size=window))
    return float(structural_similarity(real, guess, data_range=1.0, win_size=window, channel_axis=0))


def squared_errors(guesses: np.ndarray, reals: np.ndarray) -> np.ndarray:
    """Mean squared error of every guess [M, ...] against every real image [N, ...]: an [M, N] matrix."""
    a, b = guesses.reshape(len(guesses), -1), reals.reshape(len(reals), -1)
    return np.maximum((a * a).mean(1)[:, None] + (b * b).mean(1)[None, :] - 2.0 * (a @ b.T) / a.shape[1], 0.0)


def assign(guesses: np.ndarray, reals: np.ndarray) -> np.ndarray:
    """The real image each guess is judged against, one real image per guess at most (len(guesses) <= len(reals)):
    the assignment of least total squared error (Hungarian; the attacker does not know the order of a batch)."""
    rows, cols = linear_sum_assignment(squared_errors(guesses, reals))
    matched = np.empty(len(guesses), dtype=np.int64)
    matched[rows] = cols
    return matched


def nearest(guesses: np.ndarray, reals: np.ndarray) -> np.ndarray:
    """The closest real image (least squared error, so highest PSNR) of every guess."""
    return np.argmin(squared_errors(guesses, reals), axis=1)


def pair_quality(guesses: np.ndarray, reals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PSNR and SSIM of each guess against the real image beside it (equal-length stacks)."""
    return (
        np.array([psnr(r, g) for r, g in zip(reals, guesses)]),
        np.array([ssim(r, g) for r, g in zip(reals, guesses)]),
    )


def mean_interval(
    values: np.ndarray, *, level: float = CONFIDENCE, bounds: tuple[float, float] = (-math.inf, math.inf)
) -> dict[str, Any]:
    """Mean with its two-sided Student-t interval over the records (None for fewer than two; kept within the values'
    possible ``bounds``), and n, median, min and max; values above the upper bound (an exact copy's infinite PSNR)
    count as that bound."""
    values = np.minimum(np.asarray(values, dtype=np.float64), bounds[1])
    n = int(values.size)
    if n == 0:
        return {"mean": None, "ci95": None, "n": 0, "median": None, "min": None, "max": None}
    mean = float(values.mean())
    interval = None
    if n >= 2:
        half = float(student_t.ppf((1.0 + level) / 2.0, n - 1)) * float(values.std(ddof=1)) / math.sqrt(n)
        interval = [max(mean - half, bounds[0]), min(mean + half, bounds[1])]
    return {
        "mean": mean,
        "ci95": interval,
        "n": n,
        "median": float(np.median(values)),
        "min": float(values.min()),
        "max": float(values.max()),
    }


def recovered_fraction(psnrs: np.ndarray, threshold: float) -> dict[str, Any]:
    """The fraction of records reconstructed at ``threshold`` dB or more, with its Clopper-Pearson interval and n."""
    hits, n = int((np.asarray(psnrs) >= threshold).sum()), int(np.asarray(psnrs).size)
    return {
        "threshold_db": threshold,
        "fraction": None if n == 0 else hits / n,
        "ci95": None if n == 0 else rate_interval(hits, n),
        "recovered": hits,
        "n": n,
    }


def quality_summary(psnrs: np.ndarray, ssims: np.ndarray, threshold: float) -> dict[str, Any]:
    """The three numbers a reconstruction is judged by, each with its interval and n."""
    return {
        "psnr": mean_interval(psnrs, bounds=(0.0, PSNR_CAP)),
        "ssim": mean_interval(ssims, bounds=(-1.0, 1.0)),
        "recovered": recovered_fraction(psnrs, threshold),
    }

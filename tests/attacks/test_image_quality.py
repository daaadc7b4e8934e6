"""The reconstruction metrics, each against its library and a value checked by hand: PSNR and SSIM (scikit-image),
the pairing of reconstructions with records (against every permutation), the intervals (SciPy), pixel space."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from sklearn.datasets import load_digits

from fedaudit.attacks.reconstruction.image_quality import (
    PSNR_CAP,
    assign,
    mean_interval,
    nearest,
    pair_quality,
    pixel_range,
    psnr,
    recovered_fraction,
    squared_errors,
    ssim,
    ssim_window,
    to_pixels,
)
from fedaudit.data import load_dataset


def test_psnr_is_scikit_images_and_20_db_for_a_uniform_error_of_a_tenth() -> None:
    real = np.zeros((1, 8, 8))
    guess = np.full((1, 8, 8), 0.1)  # MSE 0.01 with a data range of 1: 10 log10(1 / 0.01) = 20 dB
    assert psnr(real, guess) == pytest.approx(20.0, abs=1e-12)
    rng = np.random.default_rng(0)
    for _ in range(5):
        a, b = rng.random((3, 9, 7)), rng.random((3, 9, 7))
        assert psnr(a, b) == pytest.approx(peak_signal_noise_ratio(a, b, data_range=1.0), rel=1e-12)
    assert psnr(real, real) == math.inf


def test_ssim_is_scikit_images_and_the_luminance_term_for_constant_images() -> None:
    # Constant images have no variance, so SSIM is its luminance term alone: (2 a b + C1) / (a^2 + b^2 + C1) with
    # C1 = (0.01 x data range)^2; for 0.5 and 0.6: 0.6001 / 0.6101 = 0.983609...
    real, guess = np.full((1, 8, 8), 0.5), np.full((1, 8, 8), 0.6)
    assert ssim(real, guess) == pytest.approx(0.6001 / 0.6101, rel=1e-9)
    assert ssim(real, real) == pytest.approx(1.0)
    rng = np.random.default_rng(1)
    gray_a, gray_b = rng.random((1, 28, 28)), rng.random((1, 28, 28))
    assert ssim(gray_a, gray_b) == pytest.approx(structural_similarity(gray_a[0], gray_b[0], data_range=1.0))
    rgb_a, rgb_b = rng.random((3, 12, 12)), rng.random((3, 12, 12))
    expected = structural_similarity(rgb_a, rgb_b, data_range=1.0, channel_axis=0)
    assert ssim(rgb_a, rgb_b) == pytest.approx(expected)
    small_a, small_b = rng.random((1, 4, 5)), rng.random((1, 4, 5))  # the largest odd window that fits: 3
    assert ssim(small_a, small_b) == pytest.approx(
        structural_similarity(small_a[0], small_b[0], data_range=1.0, win_size=3)
    )


def test_the_ssim_window_is_seven_or_the_largest_odd_side_that_fits() -> None:
    assert [ssim_window(s, s) for s in (28, 8, 7, 6, 5, 4, 3, 2, 1)] == [7, 7, 7, 5, 5, 3, 3, None, None]
    assert ssim_window(32, 4) == 3


def test_pixel_space_gives_back_the_raw_digits() -> None:
    """Standardised digits mapped back through the training split's range are the raw pixels / 16."""
    dataset = load_dataset("digits")
    low, high = pixel_range(dataset.train_x)
    pixels = to_pixels(dataset.train_x, low, high)
    raw = load_digits().images.astype(np.float64) / 16.0
    index = {row.tobytes(): i for i, row in enumerate(raw.reshape(len(raw), -1))}
    first = pixels[:50].reshape(50, -1)
    matches = [min(index, key=lambda key: np.abs(np.frombuffer(key) - row).max()) for row in first]
    assert max(np.abs(np.frombuffer(key) - row).max() for key, row in zip(matches, first)) < 1e-5
    assert pixels.min() == 0.0 and pixels.max() == pytest.approx(1.0, abs=1e-6)


def test_the_pairing_is_the_best_of_every_permutation_and_nearest_is_the_closest() -> None:
    rng = np.random.default_rng(2)
    for _ in range(20):
        guesses, reals = rng.random((4, 1, 3, 3)), rng.random((6, 1, 3, 3))
        errors = squared_errors(guesses, reals)
        direct = ((guesses[:, None] - reals[None]) ** 2).reshape(4, 6, -1).mean(-1)
        assert np.allclose(errors, direct)
        best = min(itertools.permutations(range(6), 4), key=lambda perm: sum(direct[i, j] for i, j in enumerate(perm)))
        chosen = assign(guesses, reals)
        assert sum(direct[i, j] for i, j in enumerate(chosen)) == pytest.approx(
            sum(direct[i, j] for i, j in enumerate(best))
        )
        assert len(set(chosen)) == 4
        assert list(nearest(guesses, reals)) == list(direct.argmin(1))


def test_pair_quality_is_each_pair_alone() -> None:
    rng = np.random.default_rng(3)
    a, b = rng.random((3, 1, 8, 8)), rng.random((3, 1, 8, 8))
    psnrs, ssims = pair_quality(b, a)
    assert list(psnrs) == [psnr(x, y) for x, y in zip(a, b)]
    assert list(ssims) == [ssim(x, y) for x, y in zip(a, b)]


def test_mean_interval_is_students_t_and_needs_two_records() -> None:
    values = np.array([12.0, 15.5, 9.25, 20.0, 17.0])
    summary = mean_interval(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=values.mean(), scale=stats.sem(values))
    assert summary["ci95"] == pytest.approx([low, high])
    assert (summary["n"], summary["median"], summary["min"], summary["max"]) == (5, 15.5, 9.25, 20.0)
    one = mean_interval(np.array([3.0]))
    assert one["ci95"] is None and one["mean"] == 3.0 and one["n"] == 1
    capped = mean_interval(np.array([math.inf, 40.0]), bounds=(0.0, PSNR_CAP))
    assert capped["mean"] == (PSNR_CAP + 40.0) / 2 and capped["ci95"][1] <= PSNR_CAP and capped["ci95"][0] >= 0.0
    assert mean_interval(np.array([]))["mean"] is None


def test_the_recovered_fraction_has_clopper_pearsons_interval() -> None:
    psnrs = np.array([25.0, 19.9, 20.0, 8.0, math.inf, 31.0, 12.0])
    recovered = recovered_fraction(psnrs, 20.0)
    assert (recovered["recovered"], recovered["n"]) == (4, 7)
    exact = stats.binomtest(4, 7).proportion_ci(0.95, method="exact")
    assert recovered["ci95"] == pytest.approx([exact.low, exact.high])
    assert recovered["fraction"] == pytest.approx(4 / 7)


def test_pixel_range_is_per_channel() -> None:
    images = torch.stack([torch.full((2, 3, 3), -1.0), torch.full((2, 3, 3), 2.0)])
    images[1, 1] = 5.0
    low, high = pixel_range(images)
    assert low.tolist() == [-1.0, -1.0] and high.tolist() == [2.0, 5.0]
    assert to_pixels(images, low, high)[1, 1].max() == 1.0 and to_pixels(images, low, high)[0].max() == 0.0

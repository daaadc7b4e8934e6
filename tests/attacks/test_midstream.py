"""The search of public streams at every offset (attacks/conformance/midstream.py): known answers from draws placed
at chosen offsets of a stream, and the null side: draws of independent streams, over many seeds, never found."""

from __future__ import annotations

import numpy as np
import torch

from fedaudit.attacks.conformance import midstream

WORDS = 1 << 18  # a shorter prefix than verify searches: the same code, a quicker test


def _stream(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_sample_or_noise_drawn_mid_stream_is_found_at_its_offset():
    """Torch draws a float32 uniform per word for torch.rand and fills a normal's tensor with uniforms before
    Box-Muller: a sample drawn after k words sits at word k, and the noise drawn right after it at k + n."""
    for offset, records, rate, shape in (
        (0, 400, 0.1, (8, 1, 3, 3)),
        (12_345, 900, 0.02, (5, 7)),
        (99_999, 300, 0.5, (33,)),
    ):
        generator = _stream(offset + 1)
        torch.rand(offset, generator=generator)
        drawn = (torch.rand(records, generator=generator) < rate).numpy()
        noise = torch.normal(0.0, 0.7, size=shape, generator=generator).reshape(-1).numpy().astype(np.float64)
        uniforms = midstream.stream_uniforms(_stream(offset + 1), WORDS)
        assert midstream.sample_offset(uniforms, drawn, rate) == offset
        # the residual verify holds is the release less a recomputed sum: off by float rounding
        rounded = noise + np.random.default_rng(offset).normal(0.0, 1e-6, noise.shape)
        assert midstream.noise_offset(uniforms, midstream.noise_uniforms(rounded, 0.7)) == offset + records


def test_independent_draws_are_never_found_and_too_few_bits_are_not_searched():
    """Fifty seeds: a sample and noise from another generator are not found in the public stream, and a sample of
    too few bits to mean anything among this many offsets is not searched (chance would match it somewhere)."""
    uniforms = midstream.stream_uniforms(_stream(0), WORDS)
    for seed in range(1, 51):
        other = _stream(10_000 + seed)
        drawn = (torch.rand(600, generator=other) < 0.1).numpy()
        noise = torch.normal(0.0, 1.0, size=(64,), generator=other).numpy().astype(np.float64)
        assert midstream.sample_offset(uniforms, drawn, 0.1) is None
        assert midstream.noise_offset(uniforms, midstream.noise_uniforms(noise, 1.0)) is None
    short = uniforms[500:530] < np.float32(0.5)  # 30 bits, found at word 500 by construction
    assert midstream.sample_offset(uniforms, short, 0.5) is None
    assert midstream.noise_uniforms(np.ones(15), 1.0) is None

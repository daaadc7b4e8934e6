"""Public streams searched at every offset, for the secrecy check (attacks/conformance/secrecy.py).

The secrecy check compares each kept query with what public streams draw at their start. A query whose noise or
sample was drawn from the middle of a public stream (torch's global generator after other draws, a client's round
stream after its initial set) escapes that comparison; without the clients' secrets nothing traced it. This module
draws a long prefix of each such stream (its uniforms, as torch's CPU generator hands them out: one 32-bit word each)
and looks for the query in it at every word offset:

- the **sample**: the records a query drew are u_i < q for consecutive uniforms u_i of the stream it drew from, so
  a window of the stream's uniforms that gives exactly the query's inclusion bits is found by narrowing the offsets
  position by position (a match must carry enough bits that chance explains none of the offsets);
- the **noise**: torch's CPU normal fills a tensor with uniforms and turns each block of 16 into 16 Gaussians by
  Box-Muller (z_j = r cos 2 pi u_{j+8}, z_{j+8} = r sin 2 pi u_{j+8}, r = sqrt(-2 log(1 - u_j))), so the first 16
  values of the query's noise give back the 16 uniforms it was drawn from, to float32 rounding, and those are looked
  up in the stream.

Only CPU streams are searched (a CUDA generator lays its draws out by thread), and only their first
:data:`WORDS` words.
"""

from __future__ import annotations

import math

import numpy as np
import torch

WORDS = 1 << 22  # words of each public stream searched (a round of a small model's draws)
NOISE_TOLERANCE = 2e-4  # how far a uniform given back by inverting float32 noise may be from the stream's
SAFETY_BITS = 40  # a match must be this many bits less likely by chance than there are offsets


def stream_uniforms(generator: torch.Generator, words: int = WORDS) -> np.ndarray:
    """The first ``words`` uniforms of a CPU generator's stream, float32, as ``torch.rand`` draws them."""
    return torch.rand(words, generator=generator).numpy()


def sample_offset(uniforms: np.ndarray, drawn: np.ndarray, rate: float) -> int | None:
    """The word offset at which the stream's uniforms give exactly the inclusion bits ``drawn`` at ``rate``, or None
    (also when ``drawn`` carries too few bits for a match to mean anything among this many offsets)."""
    drawn = np.asarray(drawn, bool)
    size = len(drawn)
    if size == 0 or len(uniforms) < size or not 0 < rate < 1:
        return None
    ones = int(drawn.sum())
    bits = -(ones * math.log2(rate) + (size - ones) * math.log2(1 - rate))
    if bits < math.log2(len(uniforms)) + SAFETY_BITS:
        return None
    included = uniforms < np.float32(rate)  # torch compares float32 uniforms with the rate in float32
    count = len(uniforms) - size + 1
    order = np.r_[np.flatnonzero(drawn), np.flatnonzero(~drawn)]  # the rarer outcome narrows fastest
    first = int(order[0])
    offsets = np.flatnonzero(included[first : first + count] == drawn[first])
    for position in order[1:]:
        offsets = offsets[included[offsets + position] == drawn[position]]
        if len(offsets) <= 1:
            break
    for offset in offsets:
        if np.array_equal(included[offset : offset + size], drawn):
            return int(offset)
    return None


def noise_uniforms(noise: np.ndarray, scale: float) -> np.ndarray | None:
    """The 16 uniforms torch's CPU normal turned into the first 16 values of ``noise`` (N(0, scale^2) draws), by
    inverting Box-Muller; None for fewer than 16 values."""
    z = np.asarray(noise, np.float64)[:16] / scale
    if len(z) < 16 or scale <= 0:
        return None
    cosine, sine = z[:8], z[8:16]
    radius_squared = cosine**2 + sine**2
    first = -np.expm1(-radius_squared / 2)  # 1 - u1 where r = sqrt(-2 log u1)
    second = np.mod(np.arctan2(sine, cosine), 2 * np.pi) / (2 * np.pi)
    return np.r_[first, second]


def noise_offset(uniforms: np.ndarray, wanted: np.ndarray | None) -> int | None:
    """The word offset at which the stream holds the 16 uniforms ``wanted`` (within float32 rounding), or None."""
    if wanted is None or len(uniforms) < 16:
        return None
    offsets = np.flatnonzero(np.abs(uniforms[: len(uniforms) - 15] - wanted[0]) < NOISE_TOLERANCE)
    for position in range(1, 16):
        offsets = offsets[_near(uniforms[offsets + position], wanted[position])]
        if not len(offsets):
            return None
    return int(offsets[0])


def _near(found: np.ndarray, wanted: float) -> np.ndarray:
    """Whether each uniform is within tolerance of ``wanted``, 0 and 1 being one point for an angle's fraction."""
    gap = np.abs(found - wanted)
    return np.minimum(gap, 1 - gap) < NOISE_TOLERANCE

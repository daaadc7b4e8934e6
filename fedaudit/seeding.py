"""Seed derivation: every public random draw of a run comes from (run seed, stream, round, client).

A client's DP noise and Poisson samples are not public: they come from the client's own secret
(:mod:`fedaudit.privacy.randomness`), or from ``--noise-seed`` through :data:`Stream.QUERY` when asked for.

Deriving independent generators per (stream, round, client) instead of
threading one generator through the run makes runs reproducible across
engines (the same client gets the same stream whether it runs in-process or
under Flower) and makes resuming exact: a checkpoint of round m plus the seed
determines everything that follows.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from fedaudit.config import MAX_SEED


class Stream(enum.IntEnum):
    """Independent purposes of randomness in a run."""

    INIT = 0
    SELECT = 1
    CLIENT = 2
    SERVER = 3
    ATTACK = 4
    CANARY_DRAW = 5  # which canaries are included, and in which client's data
    CANARY = 6  # the direction of one gradient canary
    QUERY_AUDIT = 7  # which DP queries a canary run keeps whole for the conformance checks
    SITE_SPLIT = 8  # which of a site's records its client trains on (members) and which it holds out
    EVALUATION = 9  # the fixed sample of test records the model is evaluated on (--eval-sample)
    QUERY = 10  # one DP query of a client whose noise comes from a public seed (--noise-seed): (round, client, query)
    SERVER_QUERY = 11  # a client-level DP server's draw of a round from --noise-seed: (round, draw)


# How many integer keys each stream takes: (round), (round, client), (attack draw). A fixed number per stream and
# every value below 2**32 make derive_seed injective: numpy's SeedSequence pads short entropy with zeros and splits
# larger integers into 32-bit words, so (s, stream) would equal (s, stream, 0), and (2**32, INIT) (0, SELECT, 0).
STREAM_KEYS = {
    Stream.INIT: 0,
    Stream.SELECT: 1,
    Stream.CLIENT: 2,
    Stream.SERVER: 1,
    Stream.ATTACK: 1,
    Stream.CANARY_DRAW: 0,
    Stream.CANARY: 1,
    Stream.QUERY_AUDIT: 2,
    Stream.SITE_SPLIT: 1,
    Stream.EVALUATION: 0,
    Stream.QUERY: 3,
    Stream.SERVER_QUERY: 2,
}


def derive_seed(seed: int, stream: Stream, *keys: int) -> int:
    """A 63-bit seed determined by the run seed, the stream and its integer keys (round, client, ...).

    Distinct arguments give distinct seeds: ``seed`` and every key lie in [0, 2**32) and each stream takes its
    fixed number of keys (:data:`STREAM_KEYS`); anything else is a ``ValueError``.
    """
    stream = Stream(stream)
    if len(keys) != STREAM_KEYS[stream]:
        raise ValueError(f"Stream {stream.name} takes {STREAM_KEYS[stream]} key(s), got {len(keys)}.")
    if any(not 0 <= int(value) <= MAX_SEED for value in (seed, *keys)):
        raise ValueError(f"Seeds and keys must be integers in [0, {MAX_SEED}], got {(seed, *keys)}.")
    state = np.random.SeedSequence([int(seed), int(stream), *map(int, keys)]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


# numpy's SeedSequence constants (numpy/random/bit_generator.pyx): derive_seeds repeats its hash for many keys at once.
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _XSHIFT, _POOL_SIZE = 0xCA01F9DD, 0x4973F715, 16, 4


def derive_seeds(seed: int, stream: Stream, keys: np.ndarray) -> np.ndarray:
    """:func:`derive_seed` of a one-key stream for every key in ``keys`` at once (int64, equal to it seed by seed).

    SeedSequence's entropy mixing and state generation, done on uint32 arrays (one lane per key) instead of once per
    key in Python: a canary run derives a seed for every canary of every client in every round.
    """
    stream = Stream(stream)
    if STREAM_KEYS[stream] != 1:
        raise ValueError(f"derive_seeds takes one-key streams; {stream.name} takes {STREAM_KEYS[stream]}.")
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    if not 0 <= int(seed) <= MAX_SEED or (keys.size and (keys.min() < 0 or keys.max() > MAX_SEED)):
        raise ValueError(f"Seeds and keys must be integers in [0, {MAX_SEED}].")
    lanes = keys.size
    u32 = np.uint32
    entropy = [np.full(lanes, seed, u32), np.full(lanes, int(stream), u32), keys.astype(u32)]
    hash_a = np.full(lanes, _INIT_A, u32)

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_a
        value = value ^ hash_a
        hash_a = hash_a * u32(_MULT_A)
        value = value * hash_a
        return value ^ (value >> u32(_XSHIFT))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = u32(_MIX_MULT_L) * x - u32(_MIX_MULT_R) * y
        return result ^ (result >> u32(_XSHIFT))

    with np.errstate(over="ignore"):
        pool = [hashmix(entropy[i] if i < len(entropy) else np.zeros(lanes, u32)) for i in range(_POOL_SIZE)]
        for source in range(_POOL_SIZE):
            for target in range(_POOL_SIZE):
                if source != target:
                    pool[target] = mix(pool[target], hashmix(pool[source]))
        hash_b = np.full(lanes, _INIT_B, u32)
        state = []
        for word in range(2):
            value = pool[word] ^ hash_b
            hash_b = hash_b * u32(_MULT_B)
            value = value * hash_b
            state.append(value ^ (value >> u32(_XSHIFT)))
    combined = (state[0].astype(np.uint64) << np.uint64(31)) ^ state[1].astype(np.uint64)
    return (combined & np.uint64((1 << 63) - 1)).astype(np.int64)


def make_generator(seed: int, stream: Stream, *keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` seeded by :func:`derive_seed`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, stream, *keys))
    return generator


def numpy_rng(seed: int, stream: Stream, *keys: int) -> np.random.Generator:
    """A numpy generator seeded by :func:`derive_seed`."""
    return np.random.default_rng(derive_seed(seed, stream, *keys))


def repeatable(device: torch.device) -> None:
    """Make computations on ``device`` repeatable: on CUDA, cuDNN's deterministic algorithms and no autotuning.

    Without this, cuDNN may pick convolution algorithms that sum in a varying order,
    and the same seed would not give the same run (or an exact ``--resume``) on a GPU.
    """
    if device.type == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

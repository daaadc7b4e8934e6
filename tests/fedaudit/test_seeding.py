"""fedaudit.seeding: every draw comes from a generator derived from (seed, stream, round, client), never the clock."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedaudit.seeding import STREAM_KEYS, Stream, derive_seed, derive_seeds, make_generator, numpy_rng, repeatable


def test_streams_are_distinct_and_stable():
    """The stream numbers are part of every derived seed: renumbering them would change every run."""
    assert {s.name: int(s) for s in Stream} == {
        "INIT": 0,
        "SELECT": 1,
        "CLIENT": 2,
        "SERVER": 3,
        "ATTACK": 4,
        "CANARY_DRAW": 5,
        "CANARY": 6,
        "QUERY_AUDIT": 7,
        "SITE_SPLIT": 8,
        "EVALUATION": 9,
        "QUERY": 10,
        "SERVER_QUERY": 11,
    }


def test_derive_seed_is_deterministic_and_63_bit():
    first = [derive_seed(seed, Stream.CLIENT, r, k) for seed in (0, 7) for r in range(3) for k in range(3)]
    again = [derive_seed(seed, Stream.CLIENT, r, k) for seed in (0, 7) for r in range(3) for k in range(3)]
    assert first == again
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in first)
    # a known value: the derivation must not change between versions, or old runs would not resume exactly
    assert derive_seed(0, Stream.INIT) == 6375474604893067239


def test_derive_seed_differs_across_seeds_streams_rounds_and_clients():
    tuples = [(seed, Stream.CLIENT, r, k) for seed in (0, 1, 12345) for r in range(6) for k in range(6)]
    tuples += [
        (seed, stream, r) for seed in (0, 1, 12345) for stream in (Stream.SELECT, Stream.SERVER) for r in range(6)
    ]
    seeds = {derive_seed(*t) for t in tuples}
    assert len(seeds) == len(tuples)


def test_derive_seed_depends_on_the_order_of_its_keys():
    """(round 1, client 2) and (round 2, client 1) are different clients' streams."""
    assert derive_seed(0, Stream.CLIENT, 1, 2) != derive_seed(0, Stream.CLIENT, 2, 1)


def test_derive_seed_takes_integer_like_keys():
    """Enum members (Stream, attacks' Draw) and numpy integers are keys like plain ints."""
    assert derive_seed(np.int64(3), Stream.SERVER, np.int32(2)) == derive_seed(3, 3, 2)


def test_derive_seed_refuses_what_would_collide():
    """numpy's SeedSequence pads short entropy with zeros and splits big integers into 32-bit words: (s, stream)
    would equal (s, stream, 0), and (2**32, INIT) (0, SELECT, 0). Fixed key counts and 32-bit values rule it out."""
    with pytest.raises(ValueError, match="key"):
        derive_seed(0, Stream.ATTACK)
    with pytest.raises(ValueError, match="key"):
        derive_seed(0, Stream.INIT, 0)
    with pytest.raises(ValueError, match="2"):
        derive_seed(2**32, Stream.INIT)
    with pytest.raises(ValueError):
        derive_seed(0, Stream.SELECT, 2**32)


def test_derive_seed_is_injective_on_every_combination_a_run_uses():
    seen = {}
    for seed in (0, 1, 2, 2**31, 2**32 - 1):
        combos = [(Stream.INIT,)] + [(Stream.ATTACK, d) for d in range(6)]
        combos += [(s, m) for s in (Stream.SELECT, Stream.SERVER) for m in range(6)]
        combos += [(Stream.CLIENT, m, k) for m in range(6) for k in range(6)]
        combos += [(Stream.QUERY, m, k, j) for m in range(4) for k in range(4) for j in range(4)]
        for stream, *keys in combos:
            value = derive_seed(seed, stream, *keys)
            assert value not in seen, (seen.get(value), (seed, stream, *keys))
            seen[value] = (seed, stream, *keys)


@pytest.mark.parametrize("stream", [s for s in Stream if STREAM_KEYS[s] == 1], ids=lambda s: s.name)
def test_derive_seeds_is_derive_seed_for_every_key(stream: Stream) -> None:
    """The vectorised SeedSequence hash against numpy's own, one key at a time: the edges of the key range and
    random keys, for the edge seeds and random ones."""
    rng = np.random.default_rng(int(stream))
    keys = np.concatenate([[0, 1, 2**32 - 1], rng.integers(0, 2**32, 500)])
    for seed in (0, 1, 2**32 - 1, *rng.integers(0, 2**32, 3).tolist()):
        expected = [derive_seed(int(seed), stream, int(key)) for key in keys]
        assert derive_seeds(int(seed), stream, keys).tolist() == expected
    assert derive_seeds(0, stream, np.array([], dtype=np.int64)).size == 0


def test_derive_seeds_refuses_what_derive_seed_refuses() -> None:
    for seed, keys in ((-1, [0]), (0, [-1]), (2**32, [0]), (0, [2**32])):
        with pytest.raises(ValueError):
            derive_seeds(seed, Stream.CANARY, np.array(keys))
    with pytest.raises(ValueError):
        derive_seeds(0, Stream.CLIENT, np.array([0]))


def test_negative_seeds_are_refused():
    with pytest.raises(ValueError):
        derive_seed(-1, Stream.INIT)


def test_generators_from_equal_arguments_draw_equally():
    a = make_generator(3, Stream.CLIENT, 2, 1)
    b = make_generator(3, Stream.CLIENT, 2, 1)
    assert torch.equal(torch.rand(100, generator=a), torch.rand(100, generator=b))
    assert torch.equal(torch.randn(10, generator=a), torch.randn(10, generator=b))  # and stay in step
    assert a.initial_seed() == derive_seed(3, Stream.CLIENT, 2, 1)
    assert a.device == torch.device("cpu")


def test_generators_from_different_arguments_draw_differently():
    arguments = [(3, Stream.CLIENT, 2, 1), (4, Stream.CLIENT, 2, 1), (3, Stream.SERVER, 2)]
    arguments += [(3, Stream.CLIENT, 1, 2), (3, Stream.CLIENT, 2, 0)]
    draws = [torch.rand(50, generator=make_generator(*args)) for args in arguments]
    for x, y in itertools.combinations(draws, 2):
        assert not torch.equal(x, y)


def test_generators_ignore_torchs_global_rng():
    """A derived generator does not read or advance the global generator."""
    torch.manual_seed(1)
    a = torch.rand(20, generator=make_generator(0, Stream.CLIENT, 0, 0))
    after_first = torch.rand(1)
    torch.manual_seed(2)
    b = torch.rand(20, generator=make_generator(0, Stream.CLIENT, 0, 0))
    assert torch.equal(a, b)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(1), after_first)


def test_numpy_rng_equal_and_different_arguments():
    assert np.array_equal(numpy_rng(5, Stream.SELECT, 0).random(100), numpy_rng(5, Stream.SELECT, 0).random(100))
    assert np.array_equal(
        numpy_rng(5, Stream.SELECT, 0).choice(10, 4, replace=False),
        numpy_rng(5, Stream.SELECT, 0).choice(10, 4, replace=False),
    )
    reference = numpy_rng(5, Stream.SELECT, 0).random(100)
    for args in [(6, Stream.SELECT, 0), (5, Stream.ATTACK, 0), (5, Stream.SELECT, 1)]:
        assert not np.array_equal(numpy_rng(*args).random(100), reference)
    assert isinstance(numpy_rng(5, Stream.SELECT, 0), np.random.Generator)


def test_numpy_rng_is_seeded_with_the_derived_seed():
    expected = np.random.default_rng(derive_seed(9, Stream.ATTACK, 2)).integers(0, 2**31, 20)
    assert np.array_equal(numpy_rng(9, Stream.ATTACK, 2).integers(0, 2**31, 20), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generators_draw_like_each_other():
    a = make_generator(3, Stream.CLIENT, 0, 0, device="cuda")
    b = make_generator(3, Stream.CLIENT, 0, 0, device="cuda")
    assert a.device.type == "cuda"
    assert torch.equal(torch.rand(100, generator=a, device="cuda"), torch.rand(100, generator=b, device="cuda"))


def test_repeatable_switches_cudnn_to_deterministic_on_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    repeatable(torch.device("cpu"))
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (False, True)
    repeatable(torch.device("cuda"))  # constructing the device needs no GPU
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (True, False)

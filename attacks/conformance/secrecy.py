"""Is a DP run's noise the clients' secret? The secrecy check of ``fedaudit verify``.

The guarantee of every DP query assumes that nobody who sees its release knows its noise or which records it drew.
A server, or anyone holding the run directory, knows the run's public material: the run seed (and a ``--noise-seed``
when one was given), the run id, the clients, rounds and queries. This check regenerates, for every kept whole query,
what each stream that material can produce would have drawn, in the order fedaudit's clients draw (the Poisson
sample of the query's records, its canaries' inclusion, then one Gaussian per parameter tensor), and compares:

- the **sample**: the records the query drew against the candidate's sample; independent draws disagree on each record
  with probability 2q(1 - q), so few disagreements are evidence (binomial tail);
- the **noise**: the released sum minus its clean clipped sum (recomputed by the conformance module) against the
  candidate's Gaussian draws; independent noise has correlation about N(0, 1/d) over d parameters (normal tail).

The candidates: every derived stream of :mod:`fedaudit.seeding` (each stream with every arrangement of the query's
round, client and step as its keys) from each public seed, at the start of the stream; the client's round stream
replayed through the query's predecessors as DP-FedAvg draws them (how fedaudit drew every query before client
secrets); a generator seeded with the public seed itself; and fedaudit's own key derivation with the secret
replaced by what public material could stand in for it (zeros, the seed's bytes, its hash). A match with any of them
FAILs the check. The list is finite: a stream outside it (say, torch's global generator) is caught by the second part
instead, where the clients' secrets are at hand (``RUN/client-secrets.json``): every kept query's sample and noise
must then be those the documented derivation gives from its client's secret, recomputed here with this module's own
code (``hmac``, not fedaudit's).

A run that declares public noise (``--noise-seed``) passes with a sentence that says so; a DP run that declares its
noise came from the run seed (trained before client secrets existed) fails.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import math
import stat
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from fedaudit.attacks.conformance import midstream
from fedaudit.seeding import STREAM_KEYS, Stream, derive_seed, make_generator

TRACED_CORRELATION = 0.99  # a query whose noise is the secret's stream correlates with it to float32 rounding
MAX_SECRETS_BYTES = 16 << 20


@dataclass(frozen=True)
class KeptQuery:
    """What the check needs of one kept whole query."""

    label: str
    round: int  # 0-based, as the client's keys count rounds
    client: int
    step: int  # the query's place among the client's queries of the round
    noise: torch.Tensor  # released - clean clipped sum, float64, flat, in the model's parameter order
    scale: float  # sigma C
    index: np.ndarray | None  # positions of the records it drew; None in a run that did not keep them
    population: int  # the records it sampled from
    rate: float
    canaries: int  # canaries in the client's data: the same source draws their inclusion after the records'
    device: str = "cpu"  # where its noise was drawn: torch's CPU and CUDA generators draw different streams
    threads: int | None = None  # on a GPU, the most threads its generators spread a draw over (None: not recorded)


@dataclass(frozen=True)
class PublicMaterial:
    """What anyone holding the run directory knows of its randomness."""

    seeds: tuple[int, ...]  # the run seed, and the noise seed of a --noise-seed run
    run_id: str | None
    source: str  # the manifest's declared source: client-secrets, noise-seed or run-seed
    shapes: Mapping[str, torch.Size]  # the model's trainable parameters, in order
    secure: bool  # --secure-noise: the queries drew from ChaCha20 keystreams
    noise_seed: int | None = None
    secrets: Path | None = None  # RUN/client-secrets.json, where it is at hand
    device: str = "cpu"  # where the run's clients drew, for kept queries that do not say (runs of earlier versions)


@dataclass(frozen=True)
class Finding:
    """The check's outcome (conformance.verify makes a Check of it)."""

    passed: bool
    p_value: float | None
    n: int
    statistic: float | None
    sentence: str
    details: dict[str, Any] = field(default_factory=dict)


# --- the draws of one query, as fedaudit's clients make them ---------------------------------------------------------


@dataclass(frozen=True)
class _Draws:
    mask: torch.Tensor  # bool, one per record of the population
    noise: torch.Tensor | None  # float64, flat; None: a secure stream's, which the check does not draw


def _query_draws(generator: torch.Generator, query: KeptQuery, shapes: Mapping[str, torch.Size]) -> _Draws:
    """A torch generator's draws for one query: records' uniforms, canaries' uniforms, one Gaussian per tensor."""
    device = generator.device
    mask = torch.rand(query.population, generator=generator, device=device) < query.rate
    if query.canaries:
        torch.rand(query.canaries, generator=generator, device=device)
    return _Draws(mask.cpu(), _noise_first(generator, query, shapes))


def _noise_first(generator: torch.Generator, query: KeptQuery, shapes: Mapping[str, torch.Size]) -> torch.Tensor:
    """A generator's Gaussians for the query's tensors, from where it stands (at its start: noise from a stream of
    its own)."""
    noise = [
        torch.normal(
            0.0, query.scale, size=tuple(shape), generator=generator, device=generator.device, dtype=torch.float32
        ).reshape(-1)
        for shape in shapes.values()
    ]
    return torch.cat(noise).to("cpu", torch.float64)


def _replayed(generator: torch.Generator, query: KeptQuery, shapes: Mapping[str, torch.Size]) -> _Draws:
    """The round stream as DP-FedAvg drew from it before client secrets: every earlier query's sample, canaries and
    noise, then this query's."""
    for _ in range(query.step):
        _query_draws(generator, query, shapes)
    return _query_draws(generator, query, shapes)


# --- the public candidates ---------------------------------------------------------------------------------------


def _seeded(seed: int, device: str) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


def _keyed(key: bytes, device: str) -> torch.Generator:
    """The generator docs/accounting.md derives from a 32-byte key: on the CPU, Mersenne Twister with its 624 state
    words from SHAKE-256("fedaudit/mt19937-state/v1" | key) (little-endian), about to twist; on CUDA, Philox seeded
    with the key's first 8 bytes, big-endian, top bit cleared."""
    seed = int.from_bytes(key[:8], "big") & ((1 << 63) - 1)
    if torch.device(device).type != "cpu":
        return _seeded(seed, device)
    words = struct.unpack("<624I", hashlib.shake_256(b"fedaudit/mt19937-state/v1" + key).digest(2496))
    layout = struct.pack("<QiiQ624Q", seed, 1, 1, 0, *words)  # initial seed, left, seeded, next, state
    size = torch.Generator().get_state().numel()
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(bytearray(layout.ljust(size, b"\0")), dtype=torch.uint8))
    return generator


def _arrangements(values: tuple[int, ...], arity: int) -> list[tuple[int, ...]]:
    return sorted(set(itertools.permutations(values, arity)))


def _stand_ins(seed: int) -> list[tuple[str, bytes]]:
    """What public material could stand in for a client's secret in a broken derivation."""
    return [
        ("zero secret", bytes(32)),
        (f"seed {seed} as the secret", int(seed).to_bytes(32, "big")),
        (f"SHA-256 of seed {seed} as the secret", hashlib.sha256(str(seed).encode()).digest()),
    ]


def _digest(key: bytes, *parts: bytes | int | str) -> bytes:
    """fedaudit's documented HMAC-SHA256 over length-prefixed parts (integers as 8 bytes big-endian, text ASCII)."""
    encoded = [
        p.to_bytes(8, "big") if isinstance(p, int) else p.encode("ascii") if isinstance(p, str) else p for p in parts
    ]
    message = b"".join(len(e).to_bytes(4, "big") + e for e in encoded)
    return hmac.digest(key, message, "sha256")


def _secret_query_key(secret: bytes, run_id: str, query: KeptQuery) -> bytes:
    """The 32-byte key of a query, from its client's secret (docs/accounting.md)."""
    client_key = _digest(secret, "fedaudit/client-key/v1", run_id, query.client)
    return _digest(client_key, "query", query.round, query.step)


Candidate = tuple[str, Callable[[], _Draws]]


def _seed_streams(query: KeptQuery, public: PublicMaterial) -> Iterator[tuple[str, Callable[[], torch.Generator]]]:
    """Every derived stream of fedaudit.seeding from each public seed, keyed by every arrangement of the query's
    round, client and step: a name and a fresh generator at its start."""
    values = (query.round, query.client, query.step)
    for seed in public.seeds:
        for stream in Stream:
            for keys in _arrangements(values, STREAM_KEYS[stream]):
                name = f"seed {seed}, stream {stream.name}{', keys ' + str(keys) if keys else ''}"
                yield name, lambda s=seed, st=stream, k=keys: make_generator(s, st, *k, device=query.device)


def _candidates(query: KeptQuery, public: PublicMaterial) -> Iterator[Candidate]:
    """Every public stream the check tries for ``query`` as a whole query: a name and the draws it would have made."""
    shapes, device = public.shapes, query.device
    for name, generator in _seed_streams(query, public):
        yield name, lambda g=generator: _query_draws(g(), query, shapes)
    round_stream = (query.round, query.client)
    for seed in public.seeds:
        yield f"torch seeded with {seed}", lambda s=seed: _query_draws(_seeded(s, device), query, shapes)
        yield (
            f"seed {seed}'s client stream of round {query.round + 1} replayed through step {query.step}",
            lambda s=seed: _replayed(make_generator(s, Stream.CLIENT, *round_stream, device=device), query, shapes),
        )
        if public.run_id is not None:
            for what, secret in _stand_ins(seed):
                key = _secret_query_key(secret, public.run_id, query)
                yield (
                    f"fedaudit's derivation with the {what}",
                    lambda k=key: _query_draws(_keyed(k, device), query, shapes),
                )
                if public.secure:
                    yield f"the secure stream of fedaudit's derivation with the {what}", lambda k=key: _secure(k, query)
        public_key = hashlib.sha256(
            derive_seed(seed, Stream.QUERY, query.round, query.client, query.step).to_bytes(8, "big")
        ).digest()
        yield (
            f"seed {seed}'s stream QUERY keyed as --noise-seed keys a query",
            lambda k=public_key: _query_draws(_keyed(k, device), query, shapes),
        )
        if public.secure:
            yield f"the secure stream of seed {seed}'s stream QUERY", lambda k=public_key: _secure(k, query)


def _secure(key: bytes, query: KeptQuery) -> _Draws:
    """A ChaCha20 stream's sample for the query (--secure-noise); its noise is not drawn here."""
    return _Draws(torch.from_numpy(_chacha_uniforms(key, query.population) < query.rate), None)


def _noise_only(query: KeptQuery, public: PublicMaterial) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Streams whose first draws would be the noise itself (a query's noise from a generator of its own)."""
    for name, generator in _seed_streams(query, public):
        yield f"{name}, noise first", lambda g=generator: _noise_first(g(), query, public.shapes)


# --- statistics ----------------------------------------------------------------------------------------------------


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(a.norm()) * float(b.norm())
    return float(a @ b) / denominator if denominator > 0 else 0.0


def _noise_p(correlation: float, dimension: int) -> float:
    """P(correlation >= observed) for independent noise: about N(0, 1/d)."""
    return float(stats.norm.sf(correlation * math.sqrt(max(dimension, 1))))


def _sample_p(disagreements: int, population: int, rate: float) -> float:
    """P(as few disagreements) for an independent sample: each record disagrees with probability 2q(1 - q)."""
    chance = 2 * rate * (1 - rate)
    return float(stats.binom.cdf(disagreements, population, chance)) if chance > 0 else 1.0


def _observed_mask(query: KeptQuery) -> torch.Tensor | None:
    if query.index is None:
        return None
    mask = torch.zeros(query.population, dtype=torch.bool)
    mask[torch.from_numpy(query.index)] = True
    return mask


@dataclass
class _Worst:
    p_value: float = 1.0
    what: str = ""
    statistic: float = 0.0


def _against_public(queries: list[KeptQuery], public: PublicMaterial) -> tuple[_Worst, int]:
    """The smallest p-value of any kept query's sample or noise against any public candidate, and the tests made.
    Per query only the candidate closest in noise (largest correlation) and in sample (fewest disagreements) can
    give its smallest p-values, so only theirs are computed."""
    worst, tests = _Worst(), 0
    for query in queries:
        observed = _observed_mask(query)
        noise_best, sample_best = (-2.0, ""), (query.population + 1, "")
        for name, draw in _candidates(query, public):
            draws = draw()
            if draws.noise is not None:
                noise_best = max(noise_best, (_correlation(query.noise, draws.noise), name))
                tests += 1
            if observed is not None:
                sample_best = min(sample_best, (int((observed != draws.mask).sum()), name))
                tests += 1
        for name, draw in _noise_only(query, public):
            noise_best = max(noise_best, (_correlation(query.noise, draw()), name))
            tests += 1
        rho, name = noise_best
        p_noise = _noise_p(rho, int(query.noise.numel()))
        if p_noise < worst.p_value:
            worst = _Worst(p_noise, f"the noise of {query.label} is {name} (correlation {rho:.3f})", rho)
        if observed is not None:
            disagreements, name = sample_best
            p_sample = _sample_p(disagreements, query.population, query.rate)
            if p_sample < worst.p_value:
                worst = _Worst(
                    p_sample,
                    f"the records {query.label} drew are {name}'s sample ({disagreements} of {query.population} "
                    f"records differ, {2 * query.rate * (1 - query.rate) * query.population:.1f} expected apart)",
                    float(disagreements),
                )
    return worst, tests


def _long_streams(queries: list[KeptQuery], public: PublicMaterial) -> Iterator[tuple[str, torch.Generator]]:
    """The public CPU streams searched at every offset: torch seeded with each public seed, each seed stream without
    keys, each kept query's client round stream, and torch's global generator as a process starts it."""
    for seed in public.seeds:
        yield f"torch seeded with {seed}", _seeded(seed, "cpu")
        for stream in Stream:
            if STREAM_KEYS[stream] == 0:
                yield f"seed {seed}, stream {stream.name}", make_generator(seed, stream)
        for round_index, client in sorted({(q.round, q.client) for q in queries}):
            yield (
                f"seed {seed}'s client stream of round {round_index + 1}, client {client}",
                make_generator(seed, Stream.CLIENT, round_index, client),
            )
    yield "torch's global generator as a process starts it", torch.Generator()


def _mid_stream(queries: list[KeptQuery], public: PublicMaterial) -> str | None:
    """Where a kept query's sample or noise sits inside a public stream (module midstream), or None."""
    cpu = [q for q in queries if torch.device(q.device).type == "cpu"]
    if not cpu:
        return None
    for name, generator in _long_streams(cpu, public):
        uniforms = midstream.stream_uniforms(generator)
        for query in cpu:
            observed = _observed_mask(query)
            if observed is not None:
                offset = midstream.sample_offset(uniforms, observed.numpy(), query.rate)
                if offset is not None:
                    return f"the records {query.label} drew are {name}'s uniforms from its word {offset} on"
            wanted = midstream.noise_uniforms(query.noise.numpy(), query.scale)
            offset = midstream.noise_offset(uniforms, wanted)
            if offset is not None:
                return f"the noise of {query.label} is Box-Muller of {name}'s uniforms from its word {offset} on"
    return None


# --- the clients' own secrets --------------------------------------------------------------------------------------


def _read_secrets(path: Path, run_id: str | None) -> dict[int, bytes] | str:
    """The simulated clients' secrets by client, or why they cannot be used (one sentence's clause)."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return f"{path.name} is not a regular file"
        if stat.S_IMODE(info.st_mode) & 0o077:
            return f"{path.name} can be read by other users (mode {stat.S_IMODE(info.st_mode):04o})"
        if info.st_size > MAX_SECRETS_BYTES:
            return f"{path.name} is larger than any secrets file fedaudit writes"
        data = json.loads(path.read_bytes())
        if data["run_id"] != run_id:
            return f"{path.name} holds the secrets of another run, so the noise could not be traced to this run's"
        return {int(k): bytes.fromhex(v) for k, v in data["clients"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        return f"{path.name} cannot be read ({type(exc).__name__})"


def redrawable(query: KeptQuery, threads: int, shapes: Mapping[str, torch.Size]) -> bool:
    """Whether a GPU whose generators spread a draw over at most ``threads`` threads draws from a seed what the GPU
    that made ``query`` drew: always on the CPU, where that GPU did not say (runs of earlier versions), where both
    spread draws alike, and where every draw of the query (its records' and its canaries' inclusion, one noise
    tensor per parameter) is no larger than either GPU's threads, so that neither GPU's layout of it depends on them."""
    if query.device != "cuda" or query.threads is None or query.threads == threads:
        return True
    largest = max([query.population, query.canaries, *(math.prod(shape) for shape in shapes.values())])
    return largest <= min(query.threads, threads)


def _traced(queries: list[KeptQuery], public: PublicMaterial, secrets: dict[int, bytes]) -> list[str]:
    """Every kept query whose sample or noise is not what its client's secret gives; empty when all are."""
    assert public.run_id is not None
    problems = []
    for query in queries:
        secret = secrets.get(query.client)
        if secret is None or len(secret) != 32:
            problems.append(f"client {query.client} has no 32-byte secret in {SECRETS_NAME}, though {query.label} drew")
            continue
        key = _secret_query_key(secret, public.run_id, query)
        observed = _observed_mask(query)
        if public.secure:
            uniforms = _chacha_uniforms(key, query.population)
            mask = torch.from_numpy(uniforms < query.rate)
            if observed is not None and not torch.equal(mask, observed):
                problems.append(f"the records {query.label} drew are not the sample its client's secret gives")
            continue  # the secure Gaussian is tested by its distribution (the noise check) and against public streams
        draws = _query_draws(_keyed(key, query.device), query, public.shapes)
        if observed is not None and not torch.equal(draws.mask, observed):
            problems.append(f"the records {query.label} drew are not the sample its client's secret gives")
        rho = _correlation(query.noise, draws.noise)
        if rho < TRACED_CORRELATION:
            problems.append(
                f"the noise of {query.label} is not what its client's secret gives (correlation {rho:.3f}): it came "
                "from another stream"
            )
    return problems


def _chacha_uniforms(key: bytes, count: int) -> np.ndarray:
    """The first ``count`` 53-bit uniforms of the ChaCha20 keystream of ``key`` (zero nonce and counter)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(8 * count))
    words = np.frombuffer(stream, dtype=">u8")
    return np.array([int(w) >> 11 for w in words], dtype=np.float64) / 2.0**53


SECRETS_NAME = "client-secrets.json"


def _gpu_threads() -> int:
    """The most threads this machine's GPU spreads one draw over (its multiprocessors times the threads each holds),
    read here rather than taken from the code that recorded the run's."""
    properties = torch.cuda.get_device_properties(torch.device("cuda"))
    return int(properties.multi_processor_count) * int(properties.max_threads_per_multi_processor)


def _redrawable_here(
    queries: list[KeptQuery], public: PublicMaterial, details: dict[str, Any]
) -> tuple[list[KeptQuery], Finding | None]:
    """The kept queries whose draws this machine can make again (their count left out is noted in ``details``), or
    the finding that it can make none: their noise was drawn on a GPU and this machine has none (CUDA's generators
    draw other streams than the CPU's), or a GPU that lays large draws out otherwise (:func:`redrawable`)."""
    on_gpu = [q for q in queries if torch.device(q.device).type == "cuda"]
    if on_gpu and not torch.cuda.is_available():
        details["not_checked_on_gpu"] = len(on_gpu)
        queries = [q for q in queries if torch.device(q.device).type != "cuda"]
        if not queries:
            sentence = (
                "Not checked: this run's clients drew their noise on a GPU, whose generators draw other streams than "
                "this machine's CPU; run fedaudit verify where a GPU is."
            )
            return [], Finding(True, None, 0, None, sentence, {**details, "not_checked": True})
    if not any(q.device == "cuda" for q in queries):
        return queries, None
    here = _gpu_threads()
    alike = {id(q): redrawable(q, here, public.shapes) for q in queries}
    unlike = [q for q in queries if not alike[id(q)]]
    if not unlike:
        return queries, None
    details["not_checked_on_another_gpu"] = len(unlike)
    queries = [q for q in queries if alike[id(q)]]
    if queries:
        return queries, None
    threads = ", ".join(str(t) for t in sorted({q.threads for q in unlike if q.threads is not None}))
    sentence = (
        f"Not checked: this run's clients drew their noise on a GPU whose generators spread a large draw over "
        f"{threads} threads, this one's over {here}, so it draws other values from the same seeds; run fedaudit "
        "verify on a GPU of the kind that trained it."
    )
    return [], Finding(True, None, 0, None, sentence, {**details, "not_checked": True})


def secrecy(queries: list[KeptQuery], public: PublicMaterial, level: float) -> Finding:
    """The secrecy check of a run's kept queries (module docstring), at ``level``."""
    details: dict[str, Any] = {"kept_queries": len(queries), "source": public.source}
    if public.source == "run-seed":
        return Finding(
            False,
            0.0,
            len(queries),
            None,
            "This run was trained before fedaudit kept client secrets: every client drew its noise and samples from "
            "streams of the run seed, so whoever holds config.json can regenerate and remove them.",
            details,
        )
    if not queries:
        return Finding(True, None, 0, None, "Not checked: no whole query was kept.", {**details, "not_checked": True})
    queries, unchecked = _redrawable_here(queries, public, details)
    if unchecked is not None:
        return unchecked
    worst, tests = _against_public(queries, public)
    details.update(public_tests=tests, worst=worst.what, worst_p_value=worst.p_value)
    if public.source == "noise-seed":
        return Finding(
            True,
            None,
            len(queries),
            None,
            f"Not secret, as declared: this run drew its noise from --noise-seed {public.noise_seed}, so whoever "
            f"holds that seed (config.json) can regenerate and remove it.",
            {**details, "declared_public": True},
        )
    p_value = min(1.0, worst.p_value * max(tests, 1))
    held = public.secrets is not None and public.secrets.exists()  # then the trace below catches any stream
    inside = None if p_value <= level or held else _mid_stream(queries, public)
    details["mid_stream"] = inside
    if inside is not None:
        return Finding(
            False,
            0.0,
            len(queries),
            None,
            f"The noise is not the clients' secret: {inside}, so whoever holds the run's public material can "
            "regenerate and remove it.",
            details,
        )
    if p_value <= level:
        return Finding(
            False,
            p_value,
            len(queries),
            worst.statistic,
            f"The noise is not the clients' secret: {worst.what}, so whoever holds the run's public material can "
            "regenerate and remove it.",
            details,
        )
    traced = ""
    if public.secrets is not None and public.secrets.exists():
        secrets = _read_secrets(public.secrets, public.run_id)
        if isinstance(secrets, str):
            problems = [secrets]
        else:
            problems = _traced(queries, public, secrets)
        details["traced_problems"] = problems
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            return Finding(False, 0.0, len(queries), None, f"{problems[0][0].upper()}{problems[0][1:]}{more}.", details)
        what = "samples" if public.secure else "samples and noise"
        traced = f"; their {what} are those their clients' secrets give ({SECRETS_NAME})"
    else:
        traced = f"; {SECRETS_NAME} is not here, so they were not traced to the clients' secrets"
    if details.get("not_checked_on_gpu"):
        traced += f" ({details['not_checked_on_gpu']} drawn on a GPU were not checked on this machine)"
    return Finding(
        True,
        p_value,
        len(queries),
        worst.statistic,
        f"No kept query's noise or sample matches a public stream ({tests} comparisons){traced}.",
        details,
    )

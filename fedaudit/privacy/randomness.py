"""Where a client's random draws come from: a secret that only the client holds, so that nobody else can regenerate
and subtract its noise (docs/accounting.md, "The noise is the client's secret").

The guarantee of every DP query assumes that its noise and its Poisson sample are unknown to whoever sees the
release. A client of a DP run therefore draws them from a **client secret**: 32 bytes from the operating system's
secure generator (:func:`secrets.token_bytes`), created when the client first takes part and kept where the client
keeps its state (a site's own file in a Flower deployment; ``client-secrets.json`` in the run directory for the
simulated clients of the local engine and Flower's simulation). Everything a client draws is derived from it with
HMAC-SHA256, so the party that holds it can repeat a run exactly (``--resume``) and nobody else can:

    client key  K   = HMAC(secret, "fedaudit/client-key/v1" | run id | client)
    round key       = HMAC(K, "round" | round)              the client's other draws of the round (shuffles, ...)
    query key       = HMAC(K, "query" | round | query)       one DP query: its Poisson sample, then its noise

(integers as 8 bytes big-endian, the run id as ASCII). Every DP query gets a fresh generator of its own, so its
randomness does not depend on what else the client drew, and ``fedaudit verify`` can test it against every public
stream. A generator is keyed by a whole 32-byte digest (:func:`keyed_generator`): on the CPU, the 624 words of
Mersenne Twister's state are SHAKE-256 of the digest (torch's ``manual_seed`` keeps only the low 32 bits of a seed on
the CPU, and 2**32 candidate seeds are hours of work: whoever tried them all would find a query's noise); on CUDA,
Philox's 64-bit key is the digest's first 8 bytes, big-endian, top bit cleared (63 secret bits).

Reproducible noise is available for experiments (``--noise-seed N``): the same derivation from a public seed, whose
holder can remove the noise. A run without any DP randomness draws from the run seed, as it always did.

``--secure-noise`` replaces torch's generators of the DP queries (Mersenne Twister, float32 Box-Muller) with a
ChaCha20 keystream keyed by the query key, and each Gaussian coordinate with the sum of four float64 Box-Muller
draws, halved (Holohan and Braghin 2021, as Opacus' ``secure_mode``), added to the clipped sum in float64 and
rounded once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedaudit.config import RunConfig
from fedaudit.errors import UserError
from fedaudit.seeding import Stream, derive_seed, make_generator

SECRET_BYTES = 32
SECRETS_FILE = "client-secrets.json"  # the simulated clients' secrets, in the run directory
SECRETS_FORMAT = "fedaudit-client-secrets"
SITE_FORMAT = "fedaudit-site-secrets"
FORMAT_VERSION = 1
MAX_SECRETS_BYTES = 16 << 20  # a secrets file larger than this is not one fedaudit wrote (3,000 clients: 250 kB)
MAX_SITE_RUNS = 1000  # runs one site's file keeps secrets for (a server cannot grow it past MAX_SECRETS_BYTES)
SEED_MASK = (1 << 63) - 1
MT_LABEL = b"fedaudit/mt19937-state/v1"  # what a CPU generator's state is derived under (keyed_generator)
MT_WORDS = 624  # Mersenne Twister's state: 624 words of 32 bits
# torch's CPU generator state (a byte tensor): its seed (u64), "left" (i32), "seeded" (i32), "next" (u64), then the
# 624 state words, each stored in a u64; little-endian.
_MT_LEFT, _MT_SEEDED, _MT_NEXT, _MT_STATE = 8, 12, 16, 24
CLIENT_KEY_LABEL = b"fedaudit/client-key/v1"
# A client-level DP run's server (the trusted party of central DP) samples the round's clients and draws the noise of
# their sum from a secret of its own, kept in the run directory (mode 0600) and never sent to a client.
SERVER_SECRET_FILE = "server-secret.json"
SERVER_FORMAT = "fedaudit-server-secret"
SERVER_KEY_LABEL = b"fedaudit/server-key/v1"
SERVER_SAMPLE, SERVER_NOISE = 0, 1  # the server's two draws of a round, each from a source of its own
SERVER_SALT = 2  # and the salt of its private records of the round (fedaudit.rundir.private)

# Where a run's client randomness comes from (the manifest's "randomness" record).
CLIENT_SECRETS = "client-secrets"  # each client's own secret: the default of every run with DP randomness
NOISE_SEED = "noise-seed"  # --noise-seed: reproducible, and removable by whoever holds that seed
RUN_SEED = "run-seed"  # a run without DP randomness, or one trained before client secrets existed
SOURCES = (CLIENT_SECRETS, NOISE_SEED, RUN_SEED)


class SecretError(UserError):
    """A client secret (or its file) that cannot be used: unreadable, malformed, of another run, or exposed."""


def new_secret() -> bytes:
    """32 bytes from the operating system's cryptographically secure generator."""
    return secrets.token_bytes(SECRET_BYTES)


def new_run_id() -> str:
    """A run's public identifier (128 random bits, hex): binds client keys to one run, so that a site taking part in
    several runs with one secret draws independent noise in each."""
    return secrets.token_hex(16)


def _mac(key: bytes, *parts: bytes | int | str) -> bytes:
    """HMAC-SHA256 of the parts: integers as 8 bytes big-endian, strings as ASCII, each part preceded by its length."""
    message = bytearray()
    for part in parts:
        if isinstance(part, int):
            data = int(part).to_bytes(8, "big", signed=False)
        elif isinstance(part, str):
            data = part.encode("ascii")
        else:
            data = bytes(part)
        message += len(data).to_bytes(4, "big") + data
    return hmac.new(key, bytes(message), hashlib.sha256).digest()


def _seed_of(digest: bytes) -> int:
    """A torch seed: the first 8 bytes, big-endian, top bit cleared."""
    return int.from_bytes(digest[:8], "big") & SEED_MASK


def _mt_state_words(key: bytes) -> np.ndarray:
    """The 624 Mersenne Twister state words a CPU generator keyed by ``key`` starts from: SHAKE-256(label | key)."""
    return np.frombuffer(hashlib.shake_256(MT_LABEL + bytes(key)).digest(4 * MT_WORDS), dtype="<u4")


def keyed_generator(key: bytes, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` whose randomness is all of ``key`` (32 bytes): on the CPU every word of
    Mersenne Twister's state comes from it (module docstring), the generator starting with a fresh twist as a seeded
    one does; on CUDA, Philox seeded with its first 8 bytes, top bit cleared."""
    generator = torch.Generator(device=device)
    if generator.device.type != "cpu":
        generator.manual_seed(_seed_of(key))
        return generator
    raw = _blank_state().copy()
    raw[:_MT_LEFT] = np.frombuffer(_seed_of(key).to_bytes(8, "little"), dtype=np.uint8)  # what initial_seed() says
    raw[_MT_STATE : _MT_STATE + 8 * MT_WORDS].view("<u8")[:] = _mt_state_words(key)
    generator.set_state(torch.from_numpy(raw))
    return generator


@functools.cache
def _blank_state() -> np.ndarray:
    """A CPU generator's state with every field zero but "left" and "seeded" (1: the first draw twists first), and
    no Gaussian of a previous draw waiting: what :func:`keyed_generator` fills in (a copy of it). Made once from a
    generator's own state, so that its size and layout are torch's."""
    raw = torch.Generator().get_state().numpy().copy()
    raw[:] = 0
    raw[_MT_LEFT:_MT_NEXT] = np.frombuffer((1).to_bytes(4, "little") * 2, dtype=np.uint8)
    return raw


def client_key(secret: bytes, run_id: str, client: int) -> bytes:
    """K = HMAC(secret, "fedaudit/client-key/v1" | run id | client): the key every draw of ``client`` in this run
    derives from."""
    if len(secret) != SECRET_BYTES:
        raise SecretError(f"A client secret is {SECRET_BYTES} bytes, not {len(secret)}.")
    return _mac(secret, CLIENT_KEY_LABEL, run_id, int(client))


def server_key(secret: bytes, run_id: str) -> bytes:
    """HMAC(secret, "fedaudit/server-key/v1" | run id): the key every draw of a client-level DP server derives from
    (a round's client sample is its query 0, the noise on the round's sum its query 1)."""
    if len(secret) != SECRET_BYTES:
        raise SecretError(f"The server's secret is {SECRET_BYTES} bytes, not {len(secret)}.")
    return _mac(secret, SERVER_KEY_LABEL, run_id)


# --- secure sampling -----------------------------------------------------------------------------------------------


class SecureStream:
    """A DP query's randomness from a ChaCha20 keystream (``--secure-noise``): uniforms of 53 bits, and Gaussians
    that are the sum of four float64 Box-Muller draws, halved (Holohan and Braghin 2021; Opacus' ``secure_mode``)."""

    def __init__(self, key: bytes, device: torch.device | str = "cpu") -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        if len(key) != 32:
            raise ValueError(f"A ChaCha20 key is 32 bytes, not {len(key)}.")
        self._cipher = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
        self.device = torch.device(device)

    def _words(self, count: int) -> np.ndarray:
        """The next ``count`` 64-bit words of the keystream."""
        return np.frombuffer(self._cipher.update(bytes(8 * count)), dtype=">u8").astype(np.uint64)

    def uniform(self, count: int) -> np.ndarray:
        """``count`` uniforms on [0, 1), float64 with 53 random bits each."""
        return (self._words(count) >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def standard_normal(self, count: int) -> np.ndarray:
        """``count`` draws of N(0, 1), float64: each the sum of four Box-Muller draws divided by 2."""
        pairs = 2 * count  # four draws per value, two per Box-Muller pair
        u = self.uniform(2 * pairs).reshape(2, pairs)
        radius = np.sqrt(-2.0 * np.log1p(-u[0]))
        angle = 2.0 * np.pi * u[1]
        draws = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)]).reshape(4, count)
        return draws.sum(axis=0) / 2.0


Source = torch.Generator | SecureStream


def source_device(source: Source) -> torch.device:
    """The device a source's draws are made on."""
    return torch.device(source.device)


def cuda_draw_threads(device: torch.device | str) -> int:
    """The most threads torch's CUDA generators spread one draw over on ``device``: its multiprocessors times the
    threads each holds. A draw of more values than that is laid out, and its generator's state advanced, by this
    number, so two GPUs that differ in it draw other values from one seed for that draw and every draw after it."""
    properties = torch.cuda.get_device_properties(device)
    return int(properties.multi_processor_count) * int(properties.max_threads_per_multi_processor)


def uniform(source: Source, count: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``count`` uniforms on [0, 1) from ``source``, on its device (torch's generator: as ``torch.rand`` draws)."""
    if isinstance(source, torch.Generator):
        return torch.rand(count, generator=source, device=source.device, dtype=dtype)
    return torch.from_numpy(source.uniform(count)).to(source.device)


def add_gaussian(total: torch.Tensor, std: float, source: Source) -> torch.Tensor:
    """``total`` plus one draw of N(0, std^2 I): torch's generator draws in ``total``'s dtype and adds there; a
    secure stream draws and adds in float64 and rounds once to ``total``'s dtype."""
    return add_gaussians([total], std, source)[0]


def add_gaussians(totals: list[torch.Tensor], std: float, source: Source) -> list[torch.Tensor]:
    """Each of ``totals`` plus its own draw of N(0, std^2 I), drawn in their order from ``source``: the draws and
    sums of :func:`add_gaussian` tensor by tensor, with torch's generator's sums in one launch (a DP query's 14
    additions cost about as much as its draws on a small model)."""
    if not totals:
        return []
    if isinstance(source, torch.Generator):
        noise = [
            torch.normal(0.0, std, size=total.shape, generator=source, device=total.device, dtype=total.dtype)
            for total in totals
        ]
        return list(torch._foreach_add(totals, noise))
    released = []
    for total in totals:
        noise = torch.from_numpy(source.standard_normal(total.numel())).reshape(total.shape).to(total.device)
        released.append((total.to(torch.float64) + std * noise).to(total.dtype))
    return released


# --- where a client's draws come from ------------------------------------------------------------------------------


class ClientKeys(ABC):
    """Where one client's draws in one run come from: its round generators and the source of each DP query."""

    secure: bool = False
    source: str = RUN_SEED

    @abstractmethod
    def round_seed(self, round_index: int) -> int:
        """The seed of the client's generator of round ``round_index`` (draws other than its DP queries')."""

    @abstractmethod
    def query_key(self, round_index: int, query: int) -> bytes:
        """32 bytes that determine query ``query`` (0-based, in the order the client makes them) of the round."""

    @abstractmethod
    def query_seed(self, round_index: int, query: int) -> int:
        """A 63-bit seed of that query (its CUDA generator's, without ``--secure-noise``)."""

    def round_generator(self, round_index: int, device: torch.device | str) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(self.round_seed(round_index))
        return generator

    def query_source(self, round_index: int, query: int, device: torch.device | str) -> Source:
        """The randomness of one DP query: a fresh generator (or secure stream) of its own."""
        if self.secure:
            return SecureStream(self.query_key(round_index, query), device)
        if torch.device(device).type == "cpu":
            return keyed_generator(self.query_key(round_index, query), device)
        generator = torch.Generator(device=device)
        generator.manual_seed(self.query_seed(round_index, query))
        return generator


class SecretKeys(ClientKeys):
    """Draws derived from a client key K that only the client holds (module docstring)."""

    source = CLIENT_SECRETS

    def __init__(self, key: bytes, *, secure: bool = False) -> None:
        if len(key) != 32:
            raise SecretError(f"A client key is 32 bytes, not {len(key)}.")
        self.key, self.secure = bytes(key), bool(secure)

    def round_seed(self, round_index: int) -> int:
        return _seed_of(_mac(self.key, "round", int(round_index)))

    def round_generator(self, round_index: int, device: torch.device | str) -> torch.Generator:
        """Keyed by the whole round digest (on the CPU, a seed would keep 32 of its bits)."""
        return keyed_generator(_mac(self.key, "round", int(round_index)), device)

    def query_key(self, round_index: int, query: int) -> bytes:
        return _mac(self.key, "query", int(round_index), int(query))

    def query_seed(self, round_index: int, query: int) -> int:
        return _seed_of(self.query_key(round_index, query))


class SeededKeys(ClientKeys):
    """Draws derived from a public seed: the run seed (a run without DP randomness; the round generators are those
    fedaudit always used) or ``--noise-seed``. Whoever holds the seed can regenerate every draw."""

    def __init__(self, seed: int, client: int, *, secure: bool = False, source: str = RUN_SEED) -> None:
        self.seed, self.client, self.secure, self.source = int(seed), int(client), bool(secure), source

    def round_seed(self, round_index: int) -> int:
        return derive_seed(self.seed, Stream.CLIENT, int(round_index), self.client)

    def query_seed(self, round_index: int, query: int) -> int:
        return derive_seed(self.seed, Stream.QUERY, int(round_index), self.client, int(query))

    def query_key(self, round_index: int, query: int) -> bytes:
        return hashlib.sha256(self.query_seed(round_index, query).to_bytes(8, "big")).digest()

    def round_generator(self, round_index: int, device: torch.device | str) -> torch.Generator:
        return make_generator(self.seed, Stream.CLIENT, int(round_index), self.client, device=device)


class SeededServerKeys(ClientKeys):
    """A client-level DP server's draws from ``--noise-seed``: reproducible, and removable by whoever holds it."""

    source = NOISE_SEED

    def __init__(self, seed: int, *, secure: bool = False) -> None:
        self.seed, self.secure = int(seed), bool(secure)

    def round_seed(self, round_index: int) -> int:
        return self.query_seed(round_index, SERVER_SAMPLE)

    def query_seed(self, round_index: int, query: int) -> int:
        return derive_seed(self.seed, Stream.SERVER_QUERY, int(round_index), int(query))

    def query_key(self, round_index: int, query: int) -> bytes:
        return hashlib.sha256(self.query_seed(round_index, query).to_bytes(8, "big")).digest()


@dataclass
class QueryDraws:
    """The sources of one client's DP queries in one round, handed out in order: the j-th query made gets query key
    j. One per client and round (not shared between threads)."""

    keys: ClientKeys
    round: int
    device: torch.device
    made: int = field(default=0)

    def next(self) -> Source:
        """The source of the next DP query (its Poisson sample first, then its noise)."""
        source = self.keys.query_source(self.round, self.made, self.device)
        self.made += 1
        return source


# --- secret files --------------------------------------------------------------------------------------------------


def _read_private(path: Path, what: str) -> dict[str, Any]:
    """A secrets file's JSON object; refused when others may read it, when it is too large or malformed."""
    try:
        info = path.stat()
    except OSError as exc:
        raise SecretError(f"Cannot read {what} {path}: {exc.strerror or exc}.") from exc
    if not stat.S_ISREG(info.st_mode):
        raise SecretError(f"{what.capitalize()} {path} is not a regular file.")
    if info.st_mode & 0o077:
        raise SecretError(
            f"{what.capitalize()} {path} can be read by other users (mode {stat.S_IMODE(info.st_mode):04o}); whoever "
            f"reads it can remove the clients' noise: run 'chmod 600 {path}' and try again."
        )
    if info.st_size > MAX_SECRETS_BYTES:
        raise SecretError(f"{what.capitalize()} {path} is {info.st_size} bytes, larger than any fedaudit writes.")
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise SecretError(f"Cannot read {what} {path}: {exc.strerror or exc}.") from exc
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise SecretError(f"{what.capitalize()} {path} is not JSON; it is not a file fedaudit wrote.") from exc
    if not isinstance(data, dict):
        raise SecretError(f"{what.capitalize()} {path} is not a JSON object; it is not a file fedaudit wrote.")
    return data


def _check_format(data: dict[str, Any], expected: str, path: Path, what: str) -> None:
    if data.get("format") != expected or data.get("format_version") != FORMAT_VERSION:
        raise SecretError(
            f"{what.capitalize()} {path} is not a {expected} file of version {FORMAT_VERSION} (format "
            f"{data.get('format')!r}, version {data.get('format_version')!r})."
        )


def _secret_of(value: Any, path: Path, whose: str) -> bytes:
    """A secret stored as hex: exactly 32 bytes."""
    if not isinstance(value, str):
        raise SecretError(f"{whose} secret in {path} is not a hex string.")
    try:
        secret = bytes.fromhex(value)
    except ValueError as exc:
        raise SecretError(f"{whose} secret in {path} is not hex.") from exc
    if len(secret) != SECRET_BYTES:
        raise SecretError(f"{whose} secret in {path} is {len(secret)} bytes; a client secret is {SECRET_BYTES}.")
    return secret


def write_private(path: Path, data: dict[str, Any]) -> None:
    """Write a secrets file atomically with mode 0600 (readable by its owner only), flushed to disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(json.dumps(data, sort_keys=True, indent=1).encode("ascii"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class SecretStore:
    """The simulated clients' secrets of one run (``RUN/client-secrets.json``, mode 0600): created for each client
    when it first takes part, written before that round is computed."""

    def __init__(self, run_id: str, secrets_by_client: dict[int, bytes] | None = None) -> None:
        self.run_id = run_id
        self.secrets: dict[int, bytes] = dict(secrets_by_client or {})

    @classmethod
    def read(cls, path: Path, run_id: str) -> SecretStore:
        """The store at ``path``, which must hold this run's secrets.

        Raises:
            SecretError: the file is missing, unreadable, readable by others, malformed, or of another run.
        """
        data = _read_run_secrets(
            path,
            run_id,
            SECRETS_FORMAT,
            "the clients' secrets file",
            "this run's clients drew their noise from secrets kept in that file, and without it the run cannot go on "
            "exactly (a run handed over without its secrets is for reading and auditing)",
        )
        clients = data.get("clients")
        if not isinstance(clients, dict):
            raise SecretError(f"{path} has no 'clients' object; it is not a file fedaudit wrote.")
        found: dict[int, bytes] = {}
        for name, value in clients.items():
            if not (isinstance(name, str) and name.isascii() and name.isdigit()):
                raise SecretError(f"{path} names a client {name!r} that is not a client number.")
            found[int(name)] = _secret_of(value, path, f"Client {name}'s")
        return cls(run_id, found)

    def keys(self, client: int, *, secure: bool) -> SecretKeys:
        """Client ``client``'s keys (its secret is made now if it has none; :meth:`save` writes it)."""
        if client not in self.secrets:
            self.secrets[client] = new_secret()
        return SecretKeys(client_key(self.secrets[client], self.run_id, client), secure=secure)

    def missing(self, clients: list[int]) -> list[int]:
        return [k for k in clients if k not in self.secrets]

    def save(self, path: Path) -> None:
        """Write every secret to ``path`` (mode 0600)."""
        write_private(
            path,
            {
                "format": SECRETS_FORMAT,
                "format_version": FORMAT_VERSION,
                "run_id": self.run_id,
                "clients": {str(k): self.secrets[k].hex() for k in sorted(self.secrets)},
            },
        )


def read_server_secret(path: Path, run_id: str) -> bytes:
    """The secret of this run's client-level DP server, from ``path``.

    Raises:
        SecretError: the file is missing (the run cannot go on exactly without it), unreadable, readable by others,
            malformed, or of another run.
    """
    data = _read_run_secrets(
        path,
        run_id,
        SERVER_FORMAT,
        "the server's secret file",
        "this run's server sampled its clients and drew the noise of their updates from the secret kept in that "
        "file, and without it the run cannot go on exactly",
    )
    return _secret_of(data.get("secret"), path, "The server's")


def _read_run_secrets(path: Path, run_id: str, expected: str, what: str, missing: str) -> dict[str, Any]:
    """A run directory's secrets file of format ``expected``, which must be this run's (``missing``: why its absence
    stops the run)."""
    if not path.exists():
        raise SecretError(f"{path} is missing: {missing}.")
    data = _read_private(path, what)
    _check_format(data, expected, path, what)
    if data.get("run_id") != run_id:
        raise SecretError(
            f"{path} holds the secrets of another run (run id {str(data.get('run_id'))[:32]!r}, this run's is "
            f"{run_id!r}); put this run's own file back."
        )
    return data


def site_secret_path(client: int, named: str | None, data_dir: str | None) -> Path:
    """Where a site keeps its client's secret: the file its SuperNode's node config names (``secret``), else
    ``fedaudit-client-K-secret.json`` in its data directory (``data-dir``)."""
    if named:
        return Path(named).expanduser()
    if data_dir:
        return Path(data_dir).expanduser() / f"fedaudit-client-{int(client)}-secret.json"
    raise SecretError(
        f"client {client}'s SuperNode names no file for the client's secret, which keeps its noise from the server: "
        f'add secret="/site/fedaudit-client-{client}-secret.json" (or data-dir=...) to its --node-config'
    )


def site_round_keys(path: Path, run_id: str, client: int, round_index: int, inputs: str, *, secure: bool) -> SecretKeys:
    """A site's keys for one round of one run, from its secret for ``run_id`` in the site's file (made, and written
    with mode 0600, the first time the site takes part in that run; read back after a restart, so a resumed run
    goes on exactly).

    The site answers a round of a run once: ``inputs`` (a digest of everything the round's answer depends on, the
    global model included) is recorded with the round, and a request for the same round with other inputs is
    refused. Answering it would draw the same samples and noise for another point, and the difference of the two
    answers would be noiseless: a server that asked twice could remove the noise. A request with the same inputs
    (a retransmission, or a resumed run) gets the same answer, which tells nothing new.

    Raises:
        SecretError: a malformed run id, an unusable secrets file, a second request for a round with other inputs,
            or a file that already holds :data:`MAX_SITE_RUNS` runs.
    """
    if not (isinstance(run_id, str) and len(run_id) == 32 and all(c in "0123456789abcdef" for c in run_id)):
        raise SecretError(f"the server named run {str(run_id)[:40]!r}, which is not a fedaudit run id")
    lock_path = path.with_name(f".{path.name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = _read_site_file(path, client) if path.exists() else _new_site_file(client)
        runs = data["runs"]
        if run_id not in runs and len(runs) >= MAX_SITE_RUNS:
            raise SecretError(f"{path} already holds the secrets of {len(runs)} runs; start another file for new runs")
        entry = runs.setdefault(run_id, {"secret": new_secret().hex(), "rounds": {}})
        if not (isinstance(entry, dict) and isinstance(entry.get("rounds"), dict)):
            raise SecretError(f"{path} holds run {run_id}'s entry in another layout; it is not a file fedaudit wrote.")
        secret = _secret_of(entry.get("secret"), path, f"Run {run_id}'s")
        answered = entry["rounds"].get(str(int(round_index)))
        if answered is not None and answered != inputs:
            raise SecretError(
                f"client {client}'s site answered round {round_index + 1} of this run already, for other inputs "
                "(another global model or other settings); answering again would reuse its noise and let the server "
                "remove it, so resume the run with the settings that round was first run with"
            )
        if answered is None:
            entry["rounds"][str(int(round_index))] = inputs
            write_private(path, data)
    finally:
        os.close(fd)
    return SecretKeys(client_key(secret, run_id, client), secure=secure)


def _new_site_file(client: int) -> dict[str, Any]:
    return {"format": SITE_FORMAT, "format_version": FORMAT_VERSION, "client": client, "runs": {}}


def _read_site_file(path: Path, client: int) -> dict[str, Any]:
    """A site's secrets file, checked: its format, its client, its runs."""
    what = "the site's secrets file"
    data = _read_private(path, what)
    _check_format(data, SITE_FORMAT, path, what)
    if data.get("client") != client:
        raise SecretError(f"{path} holds client {data.get('client')!r}'s secrets, not client {client}'s.")
    if not isinstance(data.get("runs"), dict):
        raise SecretError(f"{path} has no 'runs' object; it is not a file fedaudit wrote.")
    return data


@dataclass
class RunRandomness:
    """Where the clients of one training session draw from, as the training process sees it: the source, the run's
    id, and for simulated clients the store of their secrets (None at a deployment, whose sites hold theirs)."""

    source: str
    run_id: str
    seed: int  # the run seed (run-seed) or the noise seed (noise-seed); unused for client secrets
    secure: bool = False
    store: SecretStore | None = None
    server_secret: bytes | None = None  # a client-level DP server's (made when first needed; see server_keys)

    @classmethod
    def for_config(cls, config: RunConfig, run_id: str, *, at_sites: bool) -> RunRandomness:
        """A new run's: client secrets for a run with DP randomness (none here when the clients are a deployment's
        sites, which make and keep their own), else a public seed."""
        priv = config.privacy
        if not config.dp_randomness:
            return cls(RUN_SEED, run_id, int(config.seed))
        if priv.noise_seed is not None:
            return cls(NOISE_SEED, run_id, int(priv.noise_seed), bool(priv.secure_noise))
        store = None if at_sites else SecretStore(run_id)
        return cls(CLIENT_SECRETS, run_id, 0, bool(priv.secure_noise), store)

    @classmethod
    def resumed(
        cls, config: RunConfig, source: str, run_id: str, secrets_path: Path, *, at_sites: bool
    ) -> RunRandomness:
        """A resumed run's, from what its manifest recorded; its simulated clients' secrets are read back.

        Raises:
            SecretError: the run's secrets file is missing, unreadable, exposed, malformed or of another run; or the
                run was trained before client secrets and drew its DP noise from the run seed.
        """
        fresh = cls.for_config(config, run_id, at_sites=at_sites)
        if source != fresh.source:
            legacy = (
                " (it was trained by a fedaudit that drew DP noise from the run seed, so it cannot be resumed exactly; "
                "it can still be attacked, verified and reported)"
                if source == RUN_SEED
                else ""
            )
            raise SecretError(
                f"This run's clients drew their random choices from the {source.replace('-', ' ')}, but its "
                f"configuration asks for the {fresh.source.replace('-', ' ')}{legacy}."
            )
        if fresh.store is not None:
            fresh.store = SecretStore.read(secrets_path, run_id)
        elif fresh.source == CLIENT_SECRETS and secrets_path.exists():
            raise SecretError(
                f"This run's clients kept their secrets in {secrets_path} (a simulated run), so it goes on where they "
                "are, on the local engine or Flower's simulation, not at sites that would draw from secrets of their "
                "own."
            )
        if config.privacy.client_level and fresh.source == CLIENT_SECRETS:
            fresh.server_secret = read_server_secret(secrets_path.with_name(SERVER_SECRET_FILE), run_id)
        return fresh

    def server_keys(self, path: Path | None) -> ClientKeys:
        """The keys of a client-level DP server's draws: from its secret (made now if it has none and written to
        ``path`` before anything is drawn from it; None keeps it in memory, for a round that is timed and thrown
        away), or from ``--noise-seed``."""
        if self.source == NOISE_SEED:
            return SeededServerKeys(self.seed, secure=self.secure)
        if self.source != CLIENT_SECRETS:
            raise RuntimeError("A server without DP randomness draws from the run seed, not from keys.")
        if self.server_secret is None:
            self.server_secret = new_secret()
            if path is not None:
                write_private(
                    path,
                    {
                        "format": SERVER_FORMAT,
                        "format_version": FORMAT_VERSION,
                        "run_id": self.run_id,
                        "secret": self.server_secret.hex(),
                    },
                )
        return SecretKeys(server_key(self.server_secret, self.run_id), secure=self.secure)

    def keys(self, client: int) -> ClientKeys:
        """Client ``client``'s keys."""
        if self.source == CLIENT_SECRETS:
            if self.store is None:
                raise RuntimeError("The server holds no client secret: each site draws from its own.")
            return self.store.keys(client, secure=self.secure)
        return SeededKeys(self.seed, client, secure=self.secure, source=self.source)

    def prepare(self, clients: list[int], secrets_path: Path | None) -> None:
        """Make the secrets of the clients taking part for the first time, and write them to ``secrets_path`` (before
        their round is computed, so that a resumed run finds what the round drew from; None: keep them in memory,
        for a round that is timed and thrown away)."""
        if self.store is not None and self.store.missing(clients):
            for client in clients:
                self.store.keys(client, secure=self.secure)
            if secrets_path is not None:
                self.store.save(secrets_path)

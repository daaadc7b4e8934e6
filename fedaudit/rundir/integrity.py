"""Tamper evidence and the one-writer lock of a run directory.

**Hashes.** manifest.json's ``files`` maps every file the run wrote (its path relative to the run) to its SHA-256.
A commit is two-phased, so that a crash at any moment leaves a run that still checks: the manifest first records
the new hashes as ``pending`` (a ``null`` for a file about to be deleted), then the files are written, then the
manifest moves them into ``files``. A file matches when it is in its committed or its pending state. Anything
else (a changed, missing or added file) is named in one sentence. The privacy ledger is also recomputed from its
own events and compared with the epsilons it states and with the configuration's mechanism.

**Signature.** ``fedaudit sign`` writes signature.json: an Ed25519 signature over the canonical JSON of the
manifest as it stood (every file's hash included), and the public key. ``verify --public-key`` checks that the key
is the one expected, that the signature is valid, and that the files still hold what was signed.

**Lock.** One writer per run directory: an advisory ``flock`` on ``.fedaudit.lock`` inside it, held for the whole
command; readers take it shared. The holder writes its pid and command into the file, so the second writer is told
who holds it.

What each check means for a user: docs/run-directory.md.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import stat
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedaudit.errors import UserError
from fedaudit.privacy.randomness import SECRETS_FILE, SERVER_SECRET_FILE
from fedaudit.rundir.private import EXPORT_RECORD

MANIFEST = "manifest.json"
SIGNATURE = "signature.json"
LOCK = ".fedaudit.lock"
CACHES = ("references",)  # attack caches, rebuilt when their key differs; results derived from them are hashed
UNNAMED_WAIT = 10.0  # seconds a writer waits for a lock whose holder did not name itself
_UNNAMED = "another fedaudit command (reading it)"
LEDGER_RTOL = 1e-6  # the same accountant replayed on the same events gives the same epsilon, up to rounding
# What an interrupted atomic write leaves (fedaudit.rundir.files.atomic_write_bytes): "." + name + "." + 8 characters
# + ".tmp".
_TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}\.tmp$")
_CHUNK = 1 << 20


class IntegrityError(UserError):
    """A run whose files or ledger are not what fedaudit wrote (one sentence naming the file and what differs)."""


class LockedError(UserError):
    """Another fedaudit command is writing (or reading) the run directory."""


def digest(data: bytes) -> str:
    """SHA-256 of ``data``, hex."""
    return hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, hex, read in chunks."""
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def untracked(relative: str) -> bool:
    """Files of a run directory that carry no hash: the manifest itself, its signature, the lock, the simulated
    clients' secrets and a client-level DP server's (which a run handed to someone else leaves out), a copy's export
    record (which files it leaves out), temporaries of
    an interrupted write (cleared by the next writer) and attack caches."""
    name = relative.rsplit("/", 1)[-1]
    top = relative.split("/", 1)[0]
    unhashed = (MANIFEST, SIGNATURE, LOCK, SECRETS_FILE, SERVER_SECRET_FILE, EXPORT_RECORD)
    return relative in unhashed or bool(_TEMPORARY.match(name)) or top in CACHES


def present_files(root: Path) -> Iterator[str]:
    """Every regular file under ``root`` that should carry a hash, as a path relative to it (symbolic links aside:
    :func:`links` names them)."""
    for folder, dirs, names in os.walk(root):
        base = Path(folder).relative_to(root)
        dirs[:] = [d for d in dirs if not (base == Path(".") and d in CACHES) and not (Path(folder) / d).is_symlink()]
        for name in names:
            relative = (base / name).as_posix()
            if not untracked(relative) and not (Path(folder) / name).is_symlink():
                yield relative


def links(root: Path) -> list[str]:
    """Every symbolic link under ``root`` (the root itself may be one), relative to it: fedaudit writes none, and
    one would lead the run's readers and writers outside it (a lock that truncates another file, results written
    into another folder, a file checked that is not the run's)."""
    found = []
    for folder, dirs, names in os.walk(root):
        base = Path(folder).relative_to(root)
        found += [(base / name).as_posix() for name in (*dirs, *names) if (Path(folder) / name).is_symlink()]
    return sorted(found)


def outside(relative: str, linked: Collection[str] = ()) -> bool:
    """Whether a path the manifest names could lead outside the run (absolute, with an empty, '.' or '..' part, or
    through one of the run's symbolic links) or is longer than any the system opens."""
    parts = relative.split("/")
    if relative.startswith("/") or "\\" in relative or any(part in ("", ".", "..") for part in parts):
        return True
    sizes = [len(part.encode("utf-8", "surrogatepass")) for part in parts]
    if sum(sizes) > 1024 or max(sizes) > 255:  # no file fedaudit writes has such a name; the system refuses to open it
        return True
    return any("/".join(parts[:i]) in linked for i in range(1, len(parts) + 1))


def copy_checked(root: Path, relative: str, destination: Path, expected: Collection[str | None] = ()) -> None:
    """Copy the run's file ``relative`` to ``destination``, opened without following a link anywhere under ``root``
    and hashed as it is copied: a file swapped for a link, or changed, after the run was checked is not copied from
    outside the run (an :class:`IntegrityError`; ``expected`` empty: any content, for the unhashed manifest)."""
    parts = relative.split("/")
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
            os.close(folder)
            folder = inner
        source = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError as exc:
        raise IntegrityError(f"{relative} cannot be copied from inside the run ({exc.strerror or exc}).") from exc
    finally:
        os.close(folder)
    hasher = hashlib.sha256()
    with os.fdopen(source, "rb") as reading:
        if not stat.S_ISREG(os.fstat(reading.fileno()).st_mode):
            raise IntegrityError(f"{relative} is not a regular file.")
        with destination.open("wb") as writing:
            for chunk in iter(lambda: reading.read(_CHUNK), b""):
                hasher.update(chunk)
                writing.write(chunk)
    if expected and hasher.hexdigest() not in expected:
        raise IntegrityError(f"{relative} changed while it was being copied (its SHA-256 is not the manifest's).")


def read_hashes(manifest: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str | None]] | None:
    """The manifest's committed and pending hashes, or None when it records none (a run of an older fedaudit, or
    a manifest whose entries were removed or broken)."""
    files, pending = manifest.get("files"), manifest.get("pending", {})
    if not isinstance(files, dict) or not isinstance(pending, dict):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return None
    if not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in pending.items()):
        return None
    return dict(files), dict(pending)


def file_problems(root: Path, files: Mapping[str, str], pending: Mapping[str, str | None]) -> list[str]:
    """Every file of ``root`` that is in neither its committed nor its pending state, one sentence each."""
    return [sentence for _, sentence in file_findings(root, files, pending)]


def file_findings(
    root: Path, files: Mapping[str, str], pending: Mapping[str, str | None], absent: Collection[str] = ()
) -> list[tuple[str, str]]:
    """:func:`file_problems` as (relative path, sentence) pairs: which files a reader must not trust. ``absent``:
    files that may be missing (a copy for others leaves out what only the server may see); present, they must
    check."""
    linked = links(root)
    problems = [(name, f"{name} is a symbolic link, which fedaudit never writes into a run") for name in linked]
    for relative in sorted(set(files) | set(pending)):
        if outside(relative, linked):
            problems.append((relative, f"manifest.json names {relative!r}, which is not a file of the run"))
            continue
        path = root / relative
        actual = file_digest(path) if path.is_file() else None
        if actual is None and relative in absent:
            continue
        allowed = {files.get(relative)}
        if relative in pending:
            allowed.add(pending[relative])
        if actual in allowed:
            continue
        if actual is None:
            sentence = f"{relative} is missing, though manifest.json records it"
        elif relative in files or pending.get(relative) is not None:
            sentence = f"{relative} was changed after fedaudit wrote it (its SHA-256 differs from manifest.json)"
        else:
            sentence = f"{relative} was not written by fedaudit (manifest.json does not record it)"
        problems.append((relative, sentence))
    known = set(files) | set(pending)
    problems += [
        (relative, f"{relative} was not written by fedaudit (manifest.json does not record it)")
        for relative in sorted(set(present_files(root)) - known)
    ]
    return problems


def settled(root: Path, files: Mapping[str, str], pending: Mapping[str, str | None]) -> dict[str, str]:
    """The committed hashes after an interrupted commit, for a run whose files check: each pending file as it is now
    (written, or deleted)."""
    result = dict(files)
    for relative in pending:
        path = root / relative
        if path.is_file():
            result[relative] = file_digest(path)
        else:
            result.pop(relative, None)
    return result


def ledger_problems(
    ledger: Any, privacy: Mapping[str, Any] | None, rounds_done: int, delta: float | None = None
) -> list[str]:
    """privacy.json against itself and the configuration: every epsilon it states, recomputed from its own events
    with the accountant it names; its mechanism (sigma, C, delta, accountant) against config.json's; and at least
    the rounds the manifest committed.

    Args:
        ledger: privacy.json's content.
        privacy: config.json's "privacy" entry (None when it has none).
        rounds_done: the rounds manifest.json committed.
        delta: the delta the configuration's accountant spends, where it is not its --delta (client-level noise in
            shares: :func:`fedaudit.config.accountant_delta`).
    """
    from fedaudit.privacy.accounting import AccountingError, PrivacyLedger

    where = "privacy.json"
    try:
        stored = PrivacyLedger.from_dict(ledger)
    except AccountingError as exc:
        return [f"{where} is inconsistent: {exc}"]
    problems = []
    config = dict(privacy or {})
    if delta is not None:
        config["delta"] = delta
    for key, name in (("noise_multiplier", "sigma"), ("max_grad_norm", "max_grad_norm"), ("delta", "delta")):
        if ledger.get(key) != config.get(key):
            problems.append(f"{where} charges {name} {ledger.get(key)!r} but config.json says {config.get(key)!r}")
    if ledger.get("accountant") != config.get("accountant"):
        said, configured = ledger.get("accountant"), config.get("accountant")
        problems.append(f"{where} uses the {said!r} accountant but config.json says {configured!r}")
    if stored.rounds < rounds_done:
        problems.append(f"{where} records {stored.rounds} rounds but manifest.json says {rounds_done} were committed")
    replay = stored.replayed()
    for number, (said, computed) in enumerate(zip(stored.epsilon_per_round, replay.epsilon_per_round), start=1):
        if not _close(said, computed):
            problems.append(
                f"{where} says epsilon {said:.6g} after round {number}, but its own events give {computed:.6g}"
            )
            break
    for client, said in sorted(stored.client_epsilons.items()):
        computed = replay.client_epsilons.get(client, math.nan)
        if not _close(said, computed):
            problems.append(
                f"{where} says client {client} spent epsilon {said:.6g}, but its own events give {computed:.6g}"
            )
            break
    return problems


def _close(said: float, computed: float) -> bool:
    if math.isinf(said) or math.isinf(computed):
        return said == computed
    return abs(said - computed) <= LEDGER_RTOL * max(1.0, abs(computed))


# --- signature -------------------------------------------------------------------------------------------------


def canonical(manifest: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: the manifest as sorted, compact JSON."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode("utf-8")


def sign(manifest: Mapping[str, Any], key_pem: bytes, where: str) -> dict[str, Any]:
    """signature.json's content: the signed manifest, the Ed25519 signature over :func:`canonical` and the public
    key (raw, base64), from a PEM private key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{where} is not an unencrypted PEM private key ({exc}).") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise UserError(f"{where} is not an Ed25519 private key; make one with 'openssl genpkey -algorithm ed25519'.")
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return {
        "algorithm": "ed25519",
        "public_key": base64.b64encode(public).decode("ascii"),
        "signature": base64.b64encode(key.sign(canonical(manifest))).decode("ascii"),
        "manifest": dict(manifest),
    }


def public_key_bytes(key_pem: bytes, where: str) -> bytes:
    """The raw Ed25519 public key of a PEM public key file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(key_pem)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{where} is not a PEM public key ({exc}).") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise UserError(f"{where} is not an Ed25519 public key.")
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def signature_problems(document: Any, expected_key: bytes) -> tuple[list[str], dict[str, Any] | None]:
    """Whether signature.json was made by ``expected_key`` over the manifest it holds; the problems and, when the
    signature holds, the signed manifest."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        public = base64.b64decode(document["public_key"], validate=True)
        signature = base64.b64decode(document["signature"], validate=True)
        manifest = document["manifest"]
        if not isinstance(manifest, dict) or document.get("algorithm") != "ed25519":
            raise TypeError("not an ed25519 signature of a manifest")
    except (KeyError, TypeError, ValueError) as exc:
        return [f"{SIGNATURE} is malformed ({exc})"], None
    if public != expected_key:
        return [f"{SIGNATURE} was made with another key than the public key given"], None
    try:
        Ed25519PublicKey.from_public_bytes(expected_key).verify(signature, canonical(manifest))
    except InvalidSignature:
        return [f"{SIGNATURE} does not verify: the signed manifest was changed after signing"], None
    return [], manifest


# --- the lock --------------------------------------------------------------------------------------------------


@dataclass
class RunLock:
    """An advisory lock on a run directory, exclusive for a writer and shared for a reader (``flock``, released by
    the kernel when the process dies, so a kill -9 never leaves a stale lock)."""

    directory: Path
    command: str
    shared: bool = False
    _fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock now or raise :class:`LockedError` naming the holder. A writer that named itself is refused at
        once; a lock held without a name (readers, or a process that is exiting and has not yet closed its copy of
        the file) is waited for up to :data:`UNNAMED_WAIT` seconds."""
        deadline = time.monotonic() + UNNAMED_WAIT
        for _ in range(1000):
            path = self.directory / LOCK
            try:  # never through a link: a writer truncates the lock, and would truncate what a link points at
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
            except FileNotFoundError:
                raise LockedError(f"{self.directory} was removed while {self.command} started.") from None
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise
                raise LockedError(f"{path} is not a regular file (fedaudit makes its lock one); remove it.") from None
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # a hard link: truncating it truncates another
                os.close(fd)
                raise LockedError(f"{path} is not a regular file of its own (fedaudit makes its lock one); remove it.")
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _holder(fd)
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                if holder == _UNNAMED and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise LockedError(f"{self.directory} is in use by {holder}; try again when it has finished.") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if not same:  # the directory was replaced while we waited for the lock: lock the new one
                os.close(fd)
                continue
            if not self.shared:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} ({self.command})".encode(), 0)
            self._fd = fd
            return self
        raise LockedError(f"{self.directory} keeps being replaced by another fedaudit command; try again later.")

    def release(self) -> None:
        if self._fd is not None:
            if not self.shared:
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> str:
    """Who holds the lock of ``fd``, as its holder wrote it ("pid N (fedaudit train)")."""
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or _UNNAMED


def is_locked(directory: Path) -> bool:
    """Whether some process holds the lock of ``directory`` (a leftover directory whose lock is free is stale)."""
    path = directory / LOCK
    if not path.is_file():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)

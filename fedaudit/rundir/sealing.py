"""A run's seal: whether its files and ledger are what fedaudit committed, its Ed25519 signature, and the copy of it
that goes to someone else (:class:`Seal`, reached as ``RunDirectory.seal``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fedaudit.rundir import integrity, private
from fedaudit.rundir.files import RunError, atomic_write_json, process_umask
from fedaudit.rundir.stores import RunFiles

# manifest.json's fields that change when attacks and verify add their results to a signed run: its file hashes and
# the time of its last write
GROWS_AFTER_SIGNING = frozenset({"files", "pending", "updated"})


class Seal:
    """Checks, signs and exports one run directory."""

    def __init__(self, run: RunFiles) -> None:
        self.run = run

    def problems(self) -> list[str]:
        """Every way the run differs from what fedaudit wrote: files changed, missing or added since their commit, a
        privacy ledger that its own events or config.json contradict; one sentence each (none: the run checks)."""
        return [sentence for _, sentence in self.findings()]

    def findings(self) -> list[tuple[str, str]]:
        """:meth:`problems` as (file, sentence) pairs, so that a reader can leave untrusted files unread (the
        manifest itself is named "manifest.json", a contradicted ledger "privacy.json")."""
        run = self.run
        document = run.read_json(run.manifest_path)
        recorded = integrity.read_hashes(document) if isinstance(document, dict) else None
        if recorded is None:
            return [
                (
                    integrity.MANIFEST,
                    "manifest.json records no SHA-256 of the run's files (written before fedaudit 0.9, or edited)",
                )
            ]
        config = self._config()
        findings = integrity.file_findings(run.path, *recorded, private.excused(run.path, config))
        unreadable = any(name in ("privacy.json", "config.json") for name, _ in findings)
        if run.privacy_path.is_file() and not unreadable:
            privacy = config.get("privacy") if isinstance(config, dict) else None
            ledger = run.read_json(run.privacy_path)
            done = document.get("rounds_done") if isinstance(document.get("rounds_done"), int) else 0
            if isinstance(ledger, dict):
                privacy = privacy if isinstance(privacy, dict) else None
                problems = integrity.ledger_problems(ledger, privacy, done, _accountant_delta(config))
            else:
                problems = ["privacy.json is not a ledger (not a JSON object)"]
            findings += [("privacy.json", problem) for problem in problems]
        return findings

    def _config(self) -> dict[str, Any]:
        """config.json's object ({} where there is none to read: the file checks report why)."""
        try:
            config = self.run.read_json(self.run.config_path) if self.run.config_path.is_file() else {}
        except RunError:
            return {}
        return config if isinstance(config, dict) else {}

    def check(self, action: str) -> None:
        """Refuse to ``action`` a run whose files or ledger were changed: an :class:`IntegrityError` naming the
        first problem (and how many more there are)."""
        problems = self.problems()
        if problems:
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            raise integrity.IntegrityError(f"Refusing to {action} {self.run.path}: {problems[0]}{more}.")

    def sign(self, key_pem: bytes, where: str) -> None:
        """Write signature.json: an Ed25519 signature (key from PEM ``key_pem``, read from ``where``) over the
        manifest, which holds every file's hash; a run whose files do not check is not signed."""
        problems = self.problems()
        if problems:
            raise integrity.IntegrityError(f"Refusing to sign {self.run.path}: {problems[0]}.")
        signed = integrity.sign(self.run.read_json(self.run.manifest_path), key_pem, where)
        atomic_write_json(self.run.signature_path, signed)

    def export(self, out: str | Path) -> int:
        """Copy the run to ``out`` for someone else (an auditor, a server): every file the manifest hashes, the
        manifest and its signature, and nothing else: never the simulated clients' secrets, whose holder can remove
        the noise, nor the lock, temporaries or caches, nor what only a client-level run's server may see
        (:mod:`fedaudit.rundir.private`: listed in the copy's export.json instead). Built beside ``out`` under a
        temporary name and renamed into place. Returns the number of files copied.

        Raises:
            RunError: ``out`` exists and is not an empty directory, or cannot be written.
            IntegrityError: the run's files do not check (a copy would pass them on).
        """
        run, target = self.run, Path(out)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise RunError(f"--out {target} already exists; export into a new directory.")
        if target.resolve().is_relative_to(run.path.resolve()):
            raise RunError(f"--out {target} is inside the run {run.path}; export it to a directory outside the run.")
        problems = self.problems()
        if problems:
            raise integrity.IntegrityError(f"Refusing to export {run.path}: {problems[0]}.")
        document = run.read_json(run.manifest_path)
        recorded = integrity.read_hashes(document) or ({}, {})
        names = sorted({*recorded[0], *(k for k, v in recorded[1].items() if v is not None)})
        names = [n for n in names if (run.path / n).is_file()]
        config = self._config()
        named = private.names_clients(names, config)
        if named:
            raise RunError(
                f"Refusing to export {run.path}: it is a client-level DP run whose manifest names the clients each "
                f"round sampled ({named[0]}: it was trained with --save-transmitted), which its guarantee keeps from "
                "everyone but the server; a copy for others needs a run trained without --save-transmitted."
            )
        record = private.export_record(names, config)
        names = [n for n in names if n not in record["left_out"]]
        names += [n for n in (integrity.MANIFEST, integrity.SIGNATURE) if (run.path / n).is_file()]
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            building = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
        except OSError as exc:
            raise RunError(f"Cannot create {target}: {exc.strerror or exc}.") from exc
        try:
            os.chmod(building, 0o777 & ~process_umask())
            for name in names:
                destination = building / name
                destination.parent.mkdir(parents=True, exist_ok=True)
                allowed = {recorded[0].get(name), recorded[1].get(name)} - {None}
                integrity.copy_checked(run.path, name, destination, allowed)
            if record["left_out"]:
                atomic_write_json(building / private.EXPORT_RECORD, record)
            if target.exists():
                target.rmdir()
            os.rename(building, target)
        except OSError as exc:
            raise RunError(f"Cannot write the copy of {run.path} to {target}: {exc.strerror or exc}.") from exc
        finally:
            shutil.rmtree(building, ignore_errors=True)
        return len(names)

    def signature_problems(self, public_key: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Whether the run was signed with ``public_key`` (raw Ed25519) and still holds what was signed: every field of
        the manifest (its file hashes aside, which grow with attack results) and every signed file. Returns the
        problems (a signed attack result that changed among them: nothing tells a rerun from a forgery), and the
        results written since signing (new attack results, and verify's own verification.json, which every verify
        rewrites): not covered."""
        run = self.run
        if not self.run.signature_path.is_file():
            return (f"{integrity.SIGNATURE} is missing: the run was not signed ('fedaudit sign')",), ()
        problems, signed = integrity.signature_problems(run.read_json(self.run.signature_path), public_key)
        recorded = None if signed is None else integrity.read_hashes(signed)
        if recorded is None:
            return tuple(problems or [f"{integrity.SIGNATURE} holds no file hashes"]), ()
        changed, rewritten = [], []
        current = run.read_json(run.manifest_path)
        for key in sorted((set(signed) | set(current)) - GROWS_AFTER_SIGNING):
            if signed.get(key) != current.get(key):
                changed.append(f"{integrity.MANIFEST}'s {key} changed after the run was signed")
        excused = private.excused(run.path, self._config())
        for relative, expected in sorted(recorded[0].items()):
            path = run.path / relative
            if relative in excused and not path.is_file():
                continue  # a copy for others leaves out what only the server may see
            if not path.is_file() or integrity.file_digest(path) != expected:
                if relative == run.verification_path.name:
                    rewritten.append(relative)  # verify's own record, rewritten by every verify
                    continue
                again = " (an attack run again after signing: sign again)" if relative.startswith("attacks/") else ""
                changed.append(f"{relative} changed after the run was signed{again}")
        unsigned = tuple(sorted({*rewritten, *(set(integrity.present_files(run.path)) - set(recorded[0]))}))
        return tuple(changed), unsigned


def _accountant_delta(config: Any) -> float | None:
    """The delta config.json's accountant spends where it is not its --delta (None: its --delta, or a configuration
    that does not load, which the other checks report)."""
    from fedaudit.config import RunConfig, accountant_delta
    from fedaudit.errors import ConfigError

    try:
        loaded = RunConfig.from_dict(config)
    except (ConfigError, TypeError, ValueError):
        return None
    return accountant_delta(loaded) if loaded.privacy.noise_in_shares else None

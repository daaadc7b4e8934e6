"""How a run directory commits its files: every file written atomically with its SHA-256 in manifest.json, the
files of a round gathered into one commit whose manifest records them as pending first, so that a crash at any moment
leaves each file in its old or its new state, both of which check; and the one-writer lock that makes the commits
one writer's. :class:`CommittedFiles` is the base of :class:`~fedaudit.rundir.directory.RunDirectory`."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedaudit.config import JSONRefused, load_json
from fedaudit.rundir import files as run_files
from fedaudit.rundir import integrity
from fedaudit.rundir.files import RunError, atomic_write_json, bounded_size, now_iso, remove_stale_temporaries
from fedaudit.rundir.records import FORMAT_VERSION, RUN_FORMAT, Manifest


class CommittedFiles:
    """A directory whose files are committed with their hashes in its manifest.json, by one writer at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, str] | None = None  # committed hashes, loaded from manifest.json when first needed
        self._staged: dict[Path, bytes | None] | None = None  # a commit being gathered (None: a deletion)
        self._staged_manifest: Manifest | None = None
        self._pending: dict[str, str | None] = {}  # hashes of a commit under way: kept if it is interrupted

    manifest_path = property(lambda self: self.path / "manifest.json")

    def lock(self, command: str, *, shared: bool = False) -> integrity.RunLock:
        """The run's one-writer lock (``shared`` for a reader), taken now; a :class:`LockedError` names the holder.

        A writer that takes it also clears the temporaries that a killed writer left beside the run's own files
        (a half-written manifest.json, say): while the lock is held no other writer runs, so they are stale."""
        if not self.path.is_dir():
            raise RunError(f"{self.path} is not a directory; expected a run directory written by 'fedaudit train'.")
        lock = integrity.RunLock(self.path, command, shared).acquire()
        if not shared:
            remove_stale_temporaries(self.path, ("",))
        return lock

    def read_json(self, path: Path) -> Any:
        """Read one of the run's JSON files; missing, too large (:data:`MAX_RUN_TEXT_BYTES`, checked before reading)
        or malformed is a :class:`RunError`."""
        try:
            bounded_size(path)
            return load_json(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise RunError(f"{self.path} is not a complete fedaudit run: {path.name} is missing.") from exc
        except JSONRefused as exc:
            raise RunError(f"{path} {exc}: fedaudit did not write it.") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunError(f"{path} is corrupt (not valid JSON).") from exc
        except RecursionError as exc:
            raise RunError(f"{path} is corrupt (nested deeper than fedaudit writes).") from exc
        except OSError as exc:
            raise RunError(f"Cannot read {path}: {exc.strerror or exc}.") from exc

    def put(self, path: Path, data: bytes) -> None:
        """Write one of the run's files (a path inside it) with its hash: gathered into the commit of
        :meth:`staged`, else committed on its own."""
        if self._staged is not None:
            self._staged[path] = data
        else:
            self._commit({path: data})

    def remove(self, paths: list[Path]) -> None:
        """Delete files of the run and their hashes (in the commit of :meth:`staged`, else on their own)."""
        if self._staged is not None:
            self._staged.update(dict.fromkeys(paths))
        else:
            self._commit(dict.fromkeys(paths))

    @contextmanager
    def staged(self) -> Iterator[None]:
        """Gather every file written (and the manifest) in the block into one commit, made when it ends: the
        manifest first records the new hashes as pending, then the files are written, then the manifest commits them.
        A crash at any moment leaves each file in its old or its new state, both of which check; an exception in the
        block writes nothing."""
        self._staged, self._staged_manifest = {}, None
        try:
            yield
            staged, manifest = self._staged, self._staged_manifest
        finally:
            self._staged = self._staged_manifest = None
        self._commit(staged, manifest)

    def write_manifest(self, manifest: Manifest) -> None:
        """Write the manifest with the hashes of every file committed so far; inside :meth:`staged`, last."""
        if self._staged is not None:
            self._staged_manifest = manifest
            return
        self._write_manifest_document(manifest.to_dict(), self._hashes(), self._pending)

    def settle(self) -> None:
        """After an interrupted commit whose files check, take every file as it now is as committed, before writing
        again (a resume)."""
        document = self.read_json(self.manifest_path)
        recorded = integrity.read_hashes(document)
        if recorded is None or not recorded[1]:
            return
        self._files = integrity.settled(self.path, *recorded)
        entries = {
            k: v for k, v in document.items() if k not in ("format", "format_version", "updated", "files", "pending")
        }
        self._write_manifest_document(entries, self._files, None)

    def _write_manifest_document(
        self, entries: Mapping[str, Any], files: Mapping[str, str], pending: Mapping[str, str | None] | None
    ) -> None:
        document = {"format": RUN_FORMAT, "format_version": FORMAT_VERSION, **entries, "updated": now_iso()}
        document["files"] = dict(sorted(files.items()))
        if pending:
            document["pending"] = dict(sorted(pending.items()))
        atomic_write_json(self.manifest_path, document)

    def _hashes(self) -> dict[str, str]:
        """The committed hashes: this object's, or manifest.json's when it has not written any yet, with an
        interrupted commit's files taken as they are (every writer checks the run's integrity before it writes)."""
        if self._files is None:
            self._files = {}
            if self.manifest_path.is_file():
                recorded = integrity.read_hashes(self.read_json(self.manifest_path))
                self._files = integrity.settled(self.path, *recorded) if recorded else {}
        return self._files

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

    def _commit(self, contents: Mapping[Path, bytes | None], manifest: Manifest | None = None) -> None:
        if not contents and manifest is None:
            return
        files = self._hashes()
        new = {self._relative(p): None if b is None else integrity.digest(b) for p, b in contents.items()}
        exists = self.manifest_path.is_file()
        entries: dict[str, Any] = {}
        if exists:
            current = self.read_json(self.manifest_path)
            entries = {
                k: v for k, v in current.items() if k not in ("format", "format_version", "updated", "files", "pending")
            }
            self._pending = {**self._pending, **new}
            self._write_manifest_document(entries, files, self._pending)
        for path, data in contents.items():
            if data is None:
                path.unlink(missing_ok=True)
            else:
                run_files.atomic_write_bytes(path, data)
        for relative, value in new.items():
            if value is None:
                files.pop(relative, None)
            else:
                files[relative] = value
        self._pending = {}
        if manifest is not None:
            self._write_manifest_document(manifest.to_dict(), files, None)
        elif exists:
            self._write_manifest_document(entries, files, None)

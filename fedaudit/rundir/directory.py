"""The run directory: the contract between train, attack and report.

Layout (every file and key: docs/run-directory.md)::

    config.json  manifest.json  membership.npz  metrics.csv  privacy.json  model.safetensors
    checkpoints/round-NNNN.safetensors (+ .json, -clients, -server, -server-kept .safetensors)  transmitted/  attacks/

Weights are safetensors and metadata JSON, so nothing is ever unpickled. Every file is written to a temporary name in
the same directory and renamed, so a crash never leaves half a file; manifest.json is written last in a round and is
the commit point that ``--resume`` trusts. :class:`RunDirectory` owns the run's top-level files, its commits and its
lock; the stores of fedaudit.rundir.stores own checkpoints/, transmitted/, queries/ and attacks/, and
fedaudit.rundir.sealing its integrity check, signature and export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from fedaudit import integrity
from fedaudit.config import ConfigError, RunConfig
from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy.randomness import SECRETS_FILE
from fedaudit.rundir import files as run_files
from fedaudit.rundir.files import (
    RunError,
    arrays_bytes,
    atomic_write_json,
    bounded_size,
    csv_bytes,
    json_bytes,
    load_tensors,
    now_iso,
    process_umask,
    read_arrays,
    remove_stale_temporaries,
    tensors_bytes,
    tensors_metadata,
)
from fedaudit.rundir.records import FORMAT_VERSION, RUN_FORMAT, Manifest
from fedaudit.rundir.sealing import Seal
from fedaudit.rundir.stores import AttackStore, CheckpointStore, QueryStore, StateStore, WireStore

if TYPE_CHECKING:
    from fedaudit.data import Dataset

METRIC_COLUMNS = ("round", "test_accuracy", "test_loss", "epsilon", "wall_seconds", "bytes_up")


class RunDirectory:
    """Reads and writes one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._files: dict[str, str] | None = None  # committed hashes, loaded from manifest.json when first needed
        self._staged: dict[Path, bytes | None] | None = None  # a commit being gathered (None: a deletion)
        self._staged_manifest: Manifest | None = None
        self.destination: Path | None = None  # where a run built under a temporary name goes once it has a round
        self._pending: dict[str, str | None] = {}  # hashes of a commit under way: kept if it is interrupted
        self.checkpoints = CheckpointStore(self)
        self.states = StateStore(self)
        self.wire = WireStore(self)
        self.queries = QueryStore(self)
        self.attacks = AttackStore(self)
        self.seal = Seal(self)

    config_path = property(lambda self: self.path / "config.json")
    manifest_path = property(lambda self: self.path / "manifest.json")
    membership_path = property(lambda self: self.path / "membership.npz")
    canaries_path = property(lambda self: self.path / "canaries.npz")  # secret inclusion bits of a canary audit
    metrics_path = property(lambda self: self.path / "metrics.csv")
    privacy_path = property(lambda self: self.path / "privacy.json")
    model_path = property(lambda self: self.path / "model.safetensors")
    checkpoints_dir = property(lambda self: self.path / "checkpoints")
    transmitted_dir = property(lambda self: self.path / "transmitted")
    attacks_dir = property(lambda self: self.path / "attacks")  # written by fedaudit attack, read by reports
    queries_dir = property(lambda self: self.path / "queries")  # canary runs: the query log of every round
    verification_path = property(lambda self: self.path / "verification.json")  # written by fedaudit verify
    signature_path = property(lambda self: self.path / integrity.SIGNATURE)  # written by fedaudit sign
    secrets_path = property(lambda self: self.path / SECRETS_FILE)  # the simulated clients' secrets (mode 0600)

    def is_run(self) -> bool:
        """True if the directory holds a fedaudit manifest."""
        return self.manifest_path.is_file()

    def is_half_made(self) -> bool:
        """A directory left by a start that was killed before its manifest existed (fedaudit before 0.2 built a run
        in place): config.json, no manifest, and nothing but the files a start writes."""
        if not self.path.is_dir() or self.is_run() or not self.config_path.is_file():
            return False
        start = {"config.json", "membership.npz", "canaries.npz", integrity.LOCK}
        return all(
            p.name in start or integrity.untracked(p.name) for p in self.path.iterdir() if p.is_file()
        ) and not any(p.is_dir() for p in self.path.iterdir())

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

    @classmethod
    def start_new(cls, out: str | Path, overwrite: bool) -> tuple[RunDirectory, list[integrity.RunLock]]:
        """A new run, built under a temporary name beside ``out`` and locked; :meth:`publish` renames it into place
        once its first round is committed, so a start that fails or is killed leaves nothing at ``out``.

        Returns the new run and the locks it holds (with ``overwrite``, also the lock of the run it replaces).
        """
        target = cls(out)
        path = target.path
        if not str(out).strip():
            raise RunError("--out must name a run directory, not an empty path.")
        if path.exists() and not path.is_dir():
            raise RunError(f"--out {path} exists and is not a directory.")
        locks: list[integrity.RunLock] = []
        if path.exists() and any(path.iterdir()):
            half = target.is_half_made()
            if not overwrite:
                if half:
                    raise RunError(
                        f"--out {path} holds a run whose start was interrupted (config.json but no manifest.json); "
                        "pass --overwrite to replace it."
                    )
                raise RunError(
                    f"--out {path} already exists; pass --resume {path} to continue it or --overwrite to replace it."
                )
            if not target.is_run() and not half:
                raise RunError(
                    f"--out {path} is a non-empty directory that is not a fedaudit run; refusing to overwrite it."
                )
            locks.append(target.lock("fedaudit train --overwrite"))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            for leftover in sorted(path.parent.glob(f".{path.name}.partial-*")) + sorted(
                path.parent.glob(f".{path.name}.replaced-*")
            ):
                if integrity.is_locked(leftover):
                    raise integrity.LockedError(
                        f"--out {path} is being created by another fedaudit command ({leftover.name} is locked)."
                    )
                shutil.rmtree(leftover, ignore_errors=True)
            partial = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
            os.chmod(partial, 0o777 & ~process_umask())
        except OSError as exc:
            for held in locks:
                held.release()
            raise RunError(f"Cannot create the run directory {path}: {exc.strerror or exc}.") from exc
        run = cls(partial)
        run.destination = path
        locks.append(run.lock("fedaudit train"))
        return run, locks

    def publish(self) -> None:
        """Rename a run built by :meth:`start_new` into place, replacing (with its lock held) the run it overwrites."""
        if self.destination is None:
            return
        target, aside = self.destination, None
        if target.exists():
            aside = target.parent / f".{target.name}.replaced-{os.getpid()}"
            os.rename(target, aside)
        try:
            os.rename(self.path, target)
        except OSError as exc:
            if aside is not None:
                os.rename(aside, target)
            raise RunError(f"Cannot move the new run into {target}: {exc.strerror or exc}.") from exc
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self.path, self.destination = target, None

    def discard(self) -> None:
        """Remove a run that :meth:`start_new` began and never published (its start failed or was interrupted)."""
        if self.destination is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def write_config(self, config: dict[str, Any]) -> None:
        self.put(self.config_path, json_bytes(config))

    def read_json(self, path: Path) -> Any:
        """Read one of the run's JSON files; missing, too large (:data:`MAX_RUN_TEXT_BYTES`, checked before reading)
        or malformed is a :class:`RunError`."""
        try:
            bounded_size(path)
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise RunError(f"{self.path} is not a complete fedaudit run: {path.name} is missing.") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunError(f"{path} is corrupt (not valid JSON).") from exc
        except RecursionError as exc:
            raise RunError(f"{path} is corrupt (nested deeper than fedaudit writes).") from exc
        except OSError as exc:
            raise RunError(f"Cannot read {path}: {exc.strerror or exc}.") from exc

    def read_config(self) -> dict[str, Any]:
        return self.read_json(self.config_path)

    def read_manifest(self) -> Manifest:
        """The manifest, checked to be a fedaudit run of a format this version reads, with every entry valid."""
        if not self.path.is_dir():
            raise RunError(f"{self.path} is not a directory; expected a run directory written by 'fedaudit train'.")
        if not self.manifest_path.exists() and self.is_half_made():
            raise RunError(
                f"{self.path} is a run whose start was interrupted before its first round (config.json but no "
                "manifest.json); start it again with 'fedaudit train --out PATH --overwrite'."
            )
        manifest = self.read_json(self.manifest_path)
        if not isinstance(manifest, dict) or manifest.get("format") != RUN_FORMAT:
            raise RunError(
                f"{self.path} is not a fedaudit run directory (its manifest.json has no fedaudit format tag)."
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise RunError(
                f"{self.path} was written in run format {manifest.get('format_version')!r} but this fedaudit reads "
                f"format {FORMAT_VERSION}."
            )
        return Manifest.from_dict(manifest, str(self.manifest_path))

    def write_manifest(self, manifest: Manifest) -> None:
        """Write the manifest with the hashes of every file committed so far; inside :meth:`staged`, last."""
        if self._staged is not None:
            self._staged_manifest = manifest
            return
        self._write_manifest_document(manifest.to_dict(), self._hashes(), self._pending)

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

    def read_run_config(self) -> RunConfig:
        """config.json as a checked :class:`RunConfig`; a malformed one or a bad value is a :class:`RunError`."""
        try:
            config = RunConfig.from_dict(self.read_config())
            config.validate()
            return config
        except (ConfigError, TypeError) as exc:
            raise RunError(f"{self.config_path} is not a valid fedaudit configuration: {exc}") from exc

    def check_dataset(self, dataset: Dataset) -> None:
        """The data found now must be the data the run was trained on (same fingerprint), or a :class:`RunError`."""
        if dataset.fingerprint != self.read_manifest().dataset.fingerprint:
            raise RunError(
                f"The {dataset.name} data found now differs from the data {self.path} was trained on "
                "(fingerprint mismatch)."
            )

    def write_membership(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.put(self.membership_path, arrays_bytes(arrays))

    def read_membership(self) -> dict[str, np.ndarray]:
        """The member/non-member index arrays (no pickled objects allowed)."""
        if not self.membership_path.is_file():
            raise RunError(f"{self.path} is not a complete fedaudit run: membership.npz is missing.")
        return read_arrays(self.membership_path)

    def write_canaries(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.put(self.canaries_path, arrays_bytes(arrays))

    def read_canaries(self) -> dict[str, np.ndarray] | None:
        """The canaries' arrays (no pickled objects), or None for a run trained without canaries."""
        return read_arrays(self.canaries_path) if self.canaries_path.is_file() else None

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        frame = pd.DataFrame(rows)
        ordered = [c for c in METRIC_COLUMNS if c in frame.columns] + [
            c for c in frame.columns if c not in METRIC_COLUMNS
        ]
        self.put(self.metrics_path, csv_bytes(frame[ordered]))

    def read_metrics(self) -> pd.DataFrame:
        if not self.metrics_path.is_file():
            return pd.DataFrame(columns=list(METRIC_COLUMNS))
        bounded_size(self.metrics_path)
        try:
            metrics = pd.read_csv(self.metrics_path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunError(f"{self.metrics_path} is not a readable CSV file ({first}).") from exc
        for column in METRIC_COLUMNS:
            if column in metrics.columns and not pd.api.types.is_numeric_dtype(metrics[column]):
                raise RunError(f"{self.metrics_path}: its column {column!r} holds values that are not numbers.")
        return metrics

    def write_privacy(self, ledger: dict[str, Any]) -> None:
        self.put(self.privacy_path, json_bytes(ledger))

    def read_privacy(self) -> dict[str, Any] | None:
        """The privacy ledger, or None for a non-DP run."""
        return self.read_json(self.privacy_path) if self.privacy_path.is_file() else None

    def save_model(self, params: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        self.put(self.model_path, tensors_bytes(params, metadata))

    def model_spec(self) -> ModelSpec:
        """The architecture recorded in manifest.json's "model" entry, to rebuild the model without unpickling."""
        return self.read_manifest().model.spec

    def load_model(self, round_number: int | None = None, device: str | torch.device = "cpu") -> nn.Module:
        """The global model after ``round_number`` (a checkpoint), or the final model.safetensors when None.

        The model is rebuilt from :meth:`model_spec` and filled from safetensors only; the
        stored tensors must match its parameters name for name and shape for shape. The final
        model must be the one of the last committed round (a run interrupted between writing
        model.safetensors and its manifest is reported as incomplete).
        """
        spec = self.model_spec()
        if round_number is None:
            path = self.model_path
            done = self.read_manifest().rounds_done
            stored = tensors_metadata(path).get("round")
            if stored != str(done):
                raise RunError(
                    f"{self.path} is incomplete: model.safetensors is from round {stored} but manifest.json records "
                    f"{done} completed rounds; resume the run with 'fedaudit train --resume {self.path}' first."
                )
        else:
            path = self.checkpoints.path(round_number)
        tensors = load_tensors(path, device)
        model = build_model(spec).to(device)
        expected = model.state_dict()
        if set(tensors) != set(expected) or any(tensors[k].shape != v.shape for k, v in expected.items()):
            raise RunError(f"The weights in {path} do not fit the {spec.arch} model described in {self.manifest_path}.")
        odd = next((k for k, v in expected.items() if tensors[k].dtype != v.dtype), None)
        if odd is not None:
            raise RunError(
                f"The weights in {path} are {str(tensors[odd].dtype).removeprefix('torch.')} ({odd}) but fedaudit "
                f"trains {str(expected[odd].dtype).removeprefix('torch.')} models; they were not written by fedaudit."
            )
        model.load_state_dict(tensors)
        model.eval()
        return model

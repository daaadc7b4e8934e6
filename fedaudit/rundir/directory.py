"""The run directory: the contract between train, attack and report.

Layout (every file and key: docs/run-directory.md)::

    config.json  manifest.json  membership.npz  metrics.csv (server-metrics.csv)  privacy.json  model.safetensors
    checkpoints/round-NNNN.safetensors (+ .json, -clients, -server, -server-kept .safetensors)  transmitted/  attacks/

Weights are safetensors and metadata JSON, so nothing is ever unpickled. Every file is written to a temporary name in
the same directory and renamed, so a crash never leaves half a file; manifest.json is written last in a round and is
the commit point that ``--resume`` trusts. :class:`RunDirectory` owns the run's top-level files, its commits and its
lock; the stores of fedaudit.rundir.stores own checkpoints/, transmitted/, queries/ and attacks/, and
fedaudit.rundir.sealing its integrity check, signature and export.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from fedaudit.config import ConfigError, RunConfig
from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy.randomness import SECRETS_FILE, SERVER_SECRET_FILE
from fedaudit.rundir import integrity
from fedaudit.rundir.commits import CommittedFiles
from fedaudit.rundir.files import (
    RunError,
    arrays_bytes,
    bounded_size,
    csv_bytes,
    json_bytes,
    load_tensors,
    process_umask,
    read_arrays,
    tensors_bytes,
    tensors_metadata,
)
from fedaudit.rundir.private import SERVER_METRICS
from fedaudit.rundir.records import FORMAT_VERSION, RUN_FORMAT, Manifest
from fedaudit.rundir.sealing import Seal
from fedaudit.rundir.stores import AttackStore, CheckpointStore, QueryStore, StateStore, WireStore

if TYPE_CHECKING:
    from fedaudit.data import Dataset

METRIC_COLUMNS = ("round", "test_accuracy", "test_loss", "epsilon", "wall_seconds", "bytes_up")


class RunDirectory(CommittedFiles):
    """Reads and writes one run directory: its top-level files here, the rest through its stores and its seal, every
    write joining the run's commits (:class:`~fedaudit.rundir.commits.CommittedFiles`)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.destination: Path | None = None  # where a run built under a temporary name goes once it has a round
        self.checkpoints = CheckpointStore(self)
        self.states = StateStore(self)
        self.wire = WireStore(self)
        self.queries = QueryStore(self)
        self.attacks = AttackStore(self)
        self.seal = Seal(self)

    config_path = property(lambda self: self.path / "config.json")
    membership_path = property(lambda self: self.path / "membership.npz")
    canaries_path = property(lambda self: self.path / "canaries.npz")  # secret inclusion bits of a canary audit
    metrics_path = property(lambda self: self.path / "metrics.csv")
    server_metrics_path = property(lambda self: self.path / SERVER_METRICS)
    privacy_path = property(lambda self: self.path / "privacy.json")
    model_path = property(lambda self: self.path / "model.safetensors")
    checkpoints_dir = property(lambda self: self.path / "checkpoints")
    transmitted_dir = property(lambda self: self.path / "transmitted")
    attacks_dir = property(lambda self: self.path / "attacks")  # written by fedaudit attack, read by reports
    queries_dir = property(lambda self: self.path / "queries")  # canary runs: the query log of every round
    canary_clients_path = property(lambda self: self.path / "canary-clients.npz")  # --canary-clients: their log
    verification_path = property(lambda self: self.path / "verification.json")  # written by fedaudit verify
    signature_path = property(lambda self: self.path / integrity.SIGNATURE)  # written by fedaudit sign
    secrets_path = property(lambda self: self.path / SECRETS_FILE)  # the simulated clients' secrets (mode 0600)
    server_secret_path = property(lambda self: self.path / SERVER_SECRET_FILE)  # a client-level DP server's (0600)

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
                if not target.is_run():
                    raise RunError(
                        f"--out {path} is a non-empty directory that is not a fedaudit run; choose another --out."
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

    def write_metrics(self, rows: list[dict[str, Any]], private: Collection[str] = ()) -> None:
        """metrics.csv, one row a round; the ``private`` columns (what only a client-level run's server may see,
        fedaudit.rundir.private) go to server-metrics.csv beside it, with the round."""
        frame = pd.DataFrame(rows)
        ordered = [c for c in METRIC_COLUMNS if c in frame.columns] + [
            c for c in frame.columns if c not in METRIC_COLUMNS
        ]
        self.put(self.metrics_path, csv_bytes(frame[[c for c in ordered if c not in private]]))
        if private:
            self.put(self.server_metrics_path, csv_bytes(frame[["round", *[c for c in ordered if c in private]]]))

    def read_metrics(self, *, server: bool = False) -> pd.DataFrame:
        """metrics.csv; with ``server``, and server-metrics.csv's columns where the run has one (a resume needs all)."""
        if not self.metrics_path.is_file():
            return pd.DataFrame(columns=list(METRIC_COLUMNS))
        metrics = self._read_csv(self.metrics_path)
        if server and self.server_metrics_path.is_file():
            extra = self._read_csv(self.server_metrics_path)
            if "round" not in extra.columns or list(extra["round"]) != list(metrics.get("round", [])):
                raise RunError(f"{self.server_metrics_path} does not hold the rounds of {self.metrics_path.name}.")
            metrics = metrics.merge(extra, on="round", how="left")
        return metrics

    def _read_csv(self, path: Path) -> pd.DataFrame:
        bounded_size(path)
        try:
            metrics = pd.read_csv(path)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunError(f"{path} is not a readable CSV file ({first}).") from exc
        for column in METRIC_COLUMNS:
            if column in metrics.columns and not pd.api.types.is_numeric_dtype(metrics[column]):
                raise RunError(f"{path}: its column {column!r} holds values that are not numbers.")
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

"""The run directory: the contract between train, attack and report.

Layout (DESIGN.md)::

    config.json  manifest.json  membership.npz  metrics.csv  privacy.json
    model.safetensors  checkpoints/round-NNNN.safetensors (+ .json)  transmitted/  attacks/

Weights are safetensors and metadata JSON, so nothing is ever unpickled.
Every file is written to a temporary name in the same directory and renamed,
so a crash never leaves half a file; manifest.json is written last in a round
and is the commit point that ``--resume`` trusts.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import shutil
import tempfile
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save
from torch import nn

import fedaudit
from fedaudit.models import ModelSpec, build_model

RUN_FORMAT = "fedaudit-run"
FORMAT_VERSION = 1
METRIC_COLUMNS = ("round", "test_accuracy", "test_loss", "epsilon", "wall_seconds", "bytes_up")


class RunError(ValueError):
    """A run directory that is missing, incomplete, or from an incompatible version (one clear sentence)."""


TEMPORARY_SUFFIX = ".tmp"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and an atomic rename.

    The file gets the mode an ordinary ``open`` would give it (0666 less the process
    umask), not the private 0600 of a temporary file, so colleagues can read shared runs.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask: from /proc where it is shown (no change to the process state, safe with threads), else read
    by setting it and setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# What tempfile.mkstemp names the temporary file of atomic_write_bytes: "." + the file's name + "." + 8 random
# characters + TEMPORARY_SUFFIX.
_TEMPORARY_NAME = re.compile(r"^\..+\.[a-z0-9_]{8}" + re.escape(TEMPORARY_SUFFIX) + "$")


def remove_stale_temporaries(
    directory: Path, folders: tuple[str, ...] = ("", "checkpoints", "transmitted")
) -> list[Path]:
    """Delete the temporary files that an interrupted :func:`atomic_write_bytes` of training left in ``directory``
    and its training ``folders`` (each folder and what is below it); nothing else, and nothing under attacks/."""
    stale: list[Path] = []
    for name in folders:
        folder = directory / name
        if not folder.is_dir():
            continue
        candidates = folder.glob("*") if not name else folder.rglob("*")
        stale += [p for p in candidates if p.is_file() and _TEMPORARY_NAME.match(p.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def atomic_write_json(path: Path, data: Any) -> None:
    """Atomically write pretty-printed JSON."""
    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode("utf-8"))


def csv_bytes(frame: pd.DataFrame) -> bytes:
    """A table as UTF-8 CSV whose floats read back exactly, whatever the pandas version (shortest round-trip repr)."""
    return frame.to_csv(index=False, float_format=lambda value: repr(float(value))).encode("utf-8")


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Atomically write tensors as safetensors (contiguous CPU copies), byte-identical for equal inputs."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    atomic_write_bytes(path, _canonical_header(save(cpu, metadata=dict(metadata or {}))))


def _canonical_header(data: bytes) -> bytes:
    """Rewrite a safetensors header with its metadata keys sorted.

    safetensors keeps ``__metadata__`` in a hash map whose iteration order
    varies from call to call, so the same weights and metadata could give
    different bytes; the same run must give the same file.
    """
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    metadata = header.pop("__metadata__", None)
    ordered = ({"__metadata__": dict(sorted(metadata.items()))} if metadata else {}) | header
    text = json.dumps(ordered, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the format pads the header with spaces to 8-byte alignment
    return len(text).to_bytes(8, "little") + text + data[8 + size :]


def load_tensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file; a missing or corrupt file is a :class:`RunError`."""
    if not path.is_file():
        raise RunError(f"Expected the weights file {path}, which does not exist.")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as exc:
        raise RunError(f"The weights file {path} is corrupt or not a safetensors file.") from exc


def tensors_metadata(path: Path) -> dict[str, str]:
    """The string metadata of a safetensors file (read from its header only)."""
    if not path.is_file():
        raise RunError(f"Expected the weights file {path}, which does not exist.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return dict(handle.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise RunError(f"The weights file {path} is corrupt or not a safetensors file.") from exc


def versions() -> dict[str, str]:
    """Versions recorded in the manifest, so a run can be reproduced and checked later."""
    import opacus

    return {
        "fedaudit": fedaudit.__version__,
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def now_iso() -> str:
    """Current UTC time, ISO 8601."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RunDirectory:
    """Reads and writes one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    config_path = property(lambda self: self.path / "config.json")
    manifest_path = property(lambda self: self.path / "manifest.json")
    membership_path = property(lambda self: self.path / "membership.npz")
    metrics_path = property(lambda self: self.path / "metrics.csv")
    privacy_path = property(lambda self: self.path / "privacy.json")
    model_path = property(lambda self: self.path / "model.safetensors")
    checkpoints_dir = property(lambda self: self.path / "checkpoints")
    transmitted_dir = property(lambda self: self.path / "transmitted")
    attacks_dir = property(lambda self: self.path / "attacks")  # written by fedaudit attack, read by reports

    def checkpoint_path(self, round_number: int) -> Path:
        """Weights of the global model after round ``round_number`` (1-based)."""
        return self.checkpoints_dir / f"round-{round_number:04d}.safetensors"

    def checkpoint_state_path(self, round_number: int) -> Path:
        """RNG state and bookkeeping saved with the checkpoint of ``round_number``."""
        return self.checkpoints_dir / f"round-{round_number:04d}.json"

    def is_run(self) -> bool:
        """True if the directory holds a fedaudit manifest."""
        return self.manifest_path.is_file()

    def prepare_new(self, overwrite: bool) -> None:
        """Create an empty run directory; with ``overwrite``, an existing run there is removed first."""
        if self.path.exists() and not self.path.is_dir():
            raise RunError(f"--out {self.path} exists and is not a directory.")
        if self.path.exists() and any(self.path.iterdir()):
            if not overwrite:
                raise RunError(
                    f"--out {self.path} already exists; pass --resume {self.path} to continue it or --overwrite to replace it."
                )
            if not self.is_run():
                raise RunError(
                    f"--out {self.path} is a non-empty directory that is not a fedaudit run; refusing to overwrite it."
                )
            shutil.rmtree(self.path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunError(f"Cannot create the run directory {self.path}: {exc.strerror or exc}.") from exc

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_json(self.config_path, config)

    def read_json(self, path: Path) -> Any:
        """Read one of the run's JSON files; missing or malformed is a :class:`RunError`."""
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise RunError(f"{self.path} is not a complete fedaudit run: {path.name} is missing.") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RunError(f"{path} is corrupt (not valid JSON).") from exc

    def read_config(self) -> dict[str, Any]:
        return self.read_json(self.config_path)

    def read_manifest(self) -> dict[str, Any]:
        """The manifest, checked to be a fedaudit run of a format this version reads."""
        if not self.path.is_dir():
            raise RunError(f"{self.path} is not a directory; expected a run directory written by 'fedaudit train'.")
        manifest = self.read_json(self.manifest_path)
        if not isinstance(manifest, dict) or manifest.get("format") != RUN_FORMAT:
            raise RunError(
                f"{self.path} is not a fedaudit run directory (its manifest.json has no fedaudit format tag)."
            )
        if manifest.get("format_version") != FORMAT_VERSION:
            raise RunError(
                f"{self.path} was written in run format {manifest.get('format_version')} but this fedaudit reads format {FORMAT_VERSION}."
            )
        return manifest

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write_json(
            self.manifest_path,
            {"format": RUN_FORMAT, "format_version": FORMAT_VERSION, **manifest, "updated": now_iso()},
        )

    def write_membership(self, arrays: Mapping[str, np.ndarray]) -> None:
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        atomic_write_bytes(self.membership_path, buffer.getvalue())

    def read_membership(self) -> dict[str, np.ndarray]:
        """The member/non-member index arrays (no pickled objects allowed)."""
        if not self.membership_path.is_file():
            raise RunError(f"{self.path} is not a complete fedaudit run: membership.npz is missing.")
        try:
            with np.load(self.membership_path, allow_pickle=False) as data:
                return {key: data[key] for key in data.files}
        except (ValueError, OSError) as exc:
            raise RunError(f"{self.membership_path} is corrupt.") from exc

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        frame = pd.DataFrame(rows)
        ordered = [c for c in METRIC_COLUMNS if c in frame.columns] + [
            c for c in frame.columns if c not in METRIC_COLUMNS
        ]
        atomic_write_bytes(self.metrics_path, csv_bytes(frame[ordered]))

    def read_metrics(self) -> pd.DataFrame:
        if not self.metrics_path.is_file():
            return pd.DataFrame(columns=list(METRIC_COLUMNS))
        return pd.read_csv(self.metrics_path)

    def write_privacy(self, ledger: dict[str, Any]) -> None:
        atomic_write_json(self.privacy_path, ledger)

    def read_privacy(self) -> dict[str, Any] | None:
        """The privacy ledger, or None for a non-DP run."""
        return self.read_json(self.privacy_path) if self.privacy_path.is_file() else None

    def save_checkpoint(self, round_number: int, params: Mapping[str, torch.Tensor], state: dict[str, Any]) -> None:
        save_tensors(self.checkpoint_path(round_number), params, {"round": str(round_number)})
        atomic_write_json(self.checkpoint_state_path(round_number), state)

    def load_checkpoint(
        self, round_number: int, device: str | torch.device = "cpu"
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        params = load_tensors(self.checkpoint_path(round_number), device)
        return params, self.read_json(self.checkpoint_state_path(round_number))

    def client_states_path(self, round_number: int) -> Path:
        """What clients keep between rounds (e.g. FedLAP synthetic sets), saved with the checkpoint."""
        return self.checkpoints_dir / f"round-{round_number:04d}-clients.safetensors"

    def save_client_states(self, round_number: int, states: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        flat = {f"client{k}/{name}": t for k, state in states.items() for name, t in state.items()}
        save_tensors(self.client_states_path(round_number), flat, {"round": str(round_number)})

    def load_client_states(
        self, round_number: int, device: str | torch.device = "cpu"
    ) -> dict[int, dict[str, torch.Tensor]]:
        path = self.client_states_path(round_number)
        if not path.is_file():
            return {}
        states: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in load_tensors(path, device).items():
            client, name = key.split("/", 1)
            states.setdefault(int(client.removeprefix("client")), {})[name] = tensor
        return states

    def save_transmitted(self, round_number: int, client_id: int, payload: Mapping[str, torch.Tensor]) -> None:
        """What one client sent in one round, for audits of what crossed the wire."""
        path = self.transmitted_dir / f"round-{round_number:04d}" / f"client-{client_id:03d}.safetensors"
        save_tensors(path, payload, {"round": str(round_number), "client": str(client_id)})

    def saved_rounds(self) -> list[int]:
        """Round numbers that have a checkpoint, ascending."""
        if not self.checkpoints_dir.is_dir():
            return []
        return sorted(
            int(p.stem.split("-")[1]) for p in self.checkpoints_dir.glob("round-[0-9][0-9][0-9][0-9].safetensors")
        )

    def save_model(self, params: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
        save_tensors(self.model_path, params, metadata)

    def model_spec(self) -> ModelSpec:
        """The architecture recorded in manifest.json's "model" entry, to rebuild the model without unpickling."""
        entry = self.read_manifest().get("model")
        try:
            shape = tuple(int(v) for v in entry["input_shape"])
            if len(shape) != 3:
                raise ValueError("input_shape must have three entries")
            return ModelSpec(
                arch=str(entry["arch"]),
                input_shape=shape,
                num_classes=int(entry["num_classes"]),
                width=int(entry["width"]),
                depth=int(entry["depth"]),
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise RunError(
                f'{self.manifest_path} has no valid "model" entry (arch, input_shape, num_classes, width, depth).'
            ) from exc

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
            done = self.read_manifest().get("rounds_done")
            stored = tensors_metadata(path).get("round")
            if stored != str(done):
                raise RunError(
                    f"{self.path} is incomplete: model.safetensors is from round {stored} but manifest.json records "
                    f"{done} completed rounds; resume the run with 'fedaudit train --resume {self.path}' first."
                )
        else:
            path = self.checkpoint_path(round_number)
        tensors = load_tensors(path, device)
        model = build_model(spec).to(device)
        expected = model.state_dict()
        if set(tensors) != set(expected) or any(tensors[k].shape != v.shape for k, v in expected.items()):
            raise RunError(f"The weights in {path} do not fit the {spec.arch} model described in {self.manifest_path}.")
        model.load_state_dict(tensors)
        model.eval()
        return model

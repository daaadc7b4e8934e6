"""How a run's files are written and read: atomically (a temporary name in the same directory, then a rename), within
a size fedaudit writes, and without unpickling (JSON, CSV, .npz without objects, safetensors)."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import platform
import re
import stat
import tempfile
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

import fedaudit
from fedaudit.arrays import ARCHIVE_ERRORS, member_bytes, read_members
from fedaudit.errors import UserError


class RunError(UserError):
    """A run directory that is missing, incomplete, or from an incompatible version (one clear sentence)."""


# The largest JSON or CSV file of a run that fedaudit reads whole: a run of 100,000 rounds writes a metrics.csv of about
# 20 MB, and an attack's scores.csv on 70,000 records about 5 MB; a file beyond this was not written by fedaudit.
MAX_RUN_TEXT_BYTES = 256 << 20


def bounded_size(path: Path, limit: int | None = None) -> None:
    """A :class:`RunError` naming ``path`` and its size when it is larger than ``limit`` (:data:`MAX_RUN_TEXT_BYTES`
    by default; checked before it is read, so a file grown to gigabytes is one sentence rather than the machine's
    memory)."""
    limit = MAX_RUN_TEXT_BYTES if limit is None else limit
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):  # /dev/zero's size is 0 and it never ends; a FIFO would wait for a writer
        raise RunError(f"{path} is not a regular file: fedaudit writes only regular files into a run.")
    size = info.st_size
    if size > limit:
        raise RunError(
            f"{path} is {size / 2**20:,.1f} MiB, larger than any file fedaudit writes ({limit / 2**20:,.1f} MiB): it "
            "was changed after the run was written."
        )


# manifest.json's fields that change when attacks and verify add their results to a signed run: its file hashes and


TEMPORARY_SUFFIX = ".tmp"
# The most an .npz of a run may take once read (membership of every record, canaries' bits, reference inclusion):
# a run of ten million records writes about 80 MiB.
MAX_RUN_ARRAY_BYTES = 1 << 30


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and an atomic rename.

    The file gets the mode an ordinary ``open`` would give it (0666 less the process
    umask), not the private 0600 of a temporary file, so colleagues can read shared runs.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def process_umask() -> int:
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
    directory: Path, folders: tuple[str, ...] = ("", "checkpoints", "transmitted"), *, names: list[str] | None = None
) -> list[Path]:
    """Delete the temporary files that an interrupted :func:`atomic_write_bytes` of training left in ``directory``
    and its training ``folders`` (each folder and what is below it); nothing else, and nothing under attacks/.
    With ``names``, only the temporaries of files of those names."""
    stale: list[Path] = []
    for name in folders:
        folder = directory / name
        if not folder.is_dir():
            continue
        candidates = folder.glob("*") if not name else folder.rglob("*")
        stale += [
            p
            for p in candidates
            if p.is_file()
            and _TEMPORARY_NAME.match(p.name)
            and (names is None or any(p.name.startswith(f".{name}.") for name in names))
        ]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def json_bytes(data: Any) -> bytes:
    """Pretty-printed JSON, UTF-8, with a final newline."""
    return (json.dumps(data, indent=2, sort_keys=False) + "\n").encode("utf-8")


def atomic_write_json(path: Path, data: Any) -> None:
    """Atomically write pretty-printed JSON."""
    atomic_write_bytes(path, json_bytes(data))


def csv_bytes(frame: pd.DataFrame) -> bytes:
    """A table as UTF-8 CSV whose floats read back exactly, whatever the pandas version (shortest round-trip repr)."""
    return frame.to_csv(index=False, float_format=lambda value: repr(float(value))).encode("utf-8")


def arrays_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Named arrays as a compressed .npz."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Atomically write named arrays as a compressed .npz."""
    atomic_write_bytes(path, arrays_bytes(arrays))


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an .npz, with pickled objects refused; a corrupt file, a member that is not an array, or
    arrays larger than any fedaudit writes (their sizes read from the headers before anything is decompressed) is a
    :class:`RunError`."""
    bounded_size(path, MAX_RUN_ARRAY_BYTES)
    try:
        sizes = member_bytes(path)
    except ARCHIVE_ERRORS as exc:
        raise RunError(f"{path} is corrupt.") from exc
    if any(count < 0 for _, count in sizes.values()):
        raise RunError(f"{path} holds a member that is not an array: fedaudit did not write it.")
    total = sum(size for size, _ in sizes.values())
    if total > MAX_RUN_ARRAY_BYTES:
        raise RunError(
            f"{path} would take {total / 2**20:,.0f} MiB once read, more than any file fedaudit writes "
            f"({MAX_RUN_ARRAY_BYTES / 2**20:,.0f} MiB): it was changed after the run was written."
        )
    try:
        return read_members(path, sizes)
    except ARCHIVE_ERRORS as exc:
        raise RunError(f"{path} is corrupt.") from exc


def tensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Tensors as safetensors (contiguous CPU copies), byte-identical for equal inputs."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return _canonical_header(save(cpu, metadata=dict(metadata or {})))


def save_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Atomically write tensors as safetensors (contiguous CPU copies), byte-identical for equal inputs."""
    atomic_write_bytes(path, tensors_bytes(tensors, metadata))


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


def load_tensors(
    path: Path, device: str | torch.device = "cpu", keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """Read a safetensors file (only the tensors whose names ``keep`` accepts, where given); a missing or corrupt
    file is a :class:`RunError`."""
    if not path.is_file():
        raise RunError(f"Expected the weights file {path}, which does not exist.")
    try:
        if keep is None:
            return load_file(str(path), device=str(device))
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            return {name: handle.get_tensor(name) for name in handle.keys() if keep(name)}
    except (SafetensorError, OSError, ValueError) as exc:
        raise RunError(f"The weights file {path} is corrupt or not a safetensors file.") from exc


def tensor_names(path: Path) -> list[str]:
    """The names of the tensors of a safetensors file (read from its header only)."""
    if not path.is_file():
        raise RunError(f"Expected the weights file {path}, which does not exist.")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
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
    """Versions recorded in the manifest, so a run can be reproduced and checked later (Opacus' from its installed
    metadata: importing it takes a second and 70 MB, which a run that needs only its RDP analysis never spends)."""
    return {
        "fedaudit": fedaudit.__version__,
        "torch": torch.__version__,
        "opacus": importlib.metadata.version("opacus"),
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def now_iso() -> str:
    """Current UTC time, ISO 8601."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

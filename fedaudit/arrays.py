"""Reading .npz archives that someone else made (a user's data, a run handed over): what each member will take in
memory, from its .npy header and the archive's directory, before anything is decompressed, and only the members
that are arrays. A compressed bomb is refused unread; a member that is not an array is never read (numpy would
read it whole, as bytes); nothing is unpickled."""

from __future__ import annotations

import zipfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

ARCHIVE_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError)


def member_bytes(path: Path) -> dict[str, tuple[int, int]]:
    """Each member's name (without ``.npy``), the bytes it takes once read (its array's, from the header, or its
    uncompressed size where that is larger) and its number of values (-1 for a member that is not an array, listed
    under its full name with its uncompressed size). Raises one of :data:`ARCHIVE_ERRORS` for an unreadable one."""
    sizes: dict[str, tuple[int, int]] = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                sizes[info.filename] = (info.file_size, -1)
                continue
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read_header(member)
            count = int(np.prod(shape, dtype=object))
            sizes[info.filename[: -len(".npy")]] = (max(info.file_size, count * dtype.itemsize), count)
    return sizes


def read_members(path: Path, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The arrays called ``names`` that the archive holds as ``.npy`` members (others are not read), pickles
    refused (numpy's ValueError)."""
    wanted = set(names)
    with np.load(path, allow_pickle=False) as data:
        held = {name[: -len(".npy")] for name in data.zip.namelist() if name.endswith(".npy")}
        return {name: data[name] for name in sorted(wanted & held)}

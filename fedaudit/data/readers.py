"""Small, strict readers for the raw dataset formats (IDX, CIFAR-10 python batches).

The readers validate everything they read and turn every problem into a
:class:`DataError` naming the offending file, so a corrupt download ends with
one clear sentence instead of a NumPy traceback. The CIFAR-10 reader unpickles
with an allow-list: only NumPy's array reconstruction is permitted, so a
tampered batch cannot run code.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import zlib
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from fedaudit.errors import UserError

__all__ = [
    "DataError",
    "open_maybe_gzip",
    "read_idx",
    "read_idx_shape",
    "fingerprint_arrays",
    "read_cifar10_batch",
]

PathLike = str | os.PathLike[str]

# IDX type byte -> big-endian NumPy dtype (http://yann.lecun.com/exdb/mnist/).
_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_CIFAR_PIXELS = 3 * 32 * 32
_GZIP_MAGIC = b"\x1f\x8b"
_DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error)


class DataError(UserError):
    """A data problem the user can fix (missing or corrupt file, unknown name).

    ``str(error)`` is one sentence saying which file was expected where and how
    to get it; the CLI prints it and exits with status 2.
    """


def open_maybe_gzip(path: PathLike) -> IO[bytes]:
    """Open ``path`` for binary reading, transparently decompressing gzip files.

    Compression is detected from the magic bytes, not the suffix, so a
    ``.gz`` that was already decompressed (or the reverse) still reads.
    """
    try:
        with open(path, "rb") as probe:
            is_gzip = probe.read(2) == _GZIP_MAGIC
        return gzip.open(path, "rb") if is_gzip else open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot open {path}: {exc.strerror or exc}.") from exc


MAX_IDX_BYTES = 2 << 30  # MNIST's images are 47 MB, EMNIST's 700 MB


def _read_all(path: PathLike, limit: int | None = None) -> bytes:
    """Read (at most ``limit`` bytes of) the possibly gzipped file at ``path``."""
    with open_maybe_gzip(path) as handle:
        try:
            return handle.read() if limit is None else handle.read(limit)
        except _DECOMPRESS_ERRORS as exc:
            if isinstance(handle, gzip.GzipFile):
                raise DataError(f"{path} is not a valid gzip file ({exc}); delete it and get it again.") from exc
            raise DataError(f"cannot read {path}: {exc}.") from exc


def _parse_idx_header(path: PathLike, head: bytes) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """Return (dtype, shape, header length) from the first bytes of an IDX file."""
    if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES:
        raise DataError(f"{path} is not an IDX file (bad magic number); delete it and get it again.")
    ndim = head[3]
    header_len = 4 + 4 * ndim
    if ndim == 0 or len(head) < header_len:
        raise DataError(f"{path} has a truncated or malformed IDX header; delete it and get it again.")
    shape = tuple(int(d) for d in np.frombuffer(head, dtype=">u4", count=ndim, offset=4))
    return _IDX_DTYPES[head[2]], shape, header_len


def read_idx_shape(path: PathLike) -> tuple[int, ...]:
    """Return the shape recorded in an IDX file's header, checked against the size of its data (streamed, not kept),
    so a truncated file is not reported with the size its header promises."""
    head = _read_all(path, limit=4 + 4 * 255)
    dtype, shape, header_len = _parse_idx_header(path, head)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = -header_len
    with open_maybe_gzip(path) as handle:
        try:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                actual += len(chunk)
        except _DECOMPRESS_ERRORS as exc:
            raise DataError(f"{path} is not a valid gzip file ({exc}); delete it and get it again.") from exc
    if actual != expected:
        raise DataError(
            f"{path} has the wrong size ({actual} data bytes where its header promises {expected}); "
            "the file is truncated or corrupt, delete it and get it again."
        )
    return shape


def read_idx(path: PathLike, *, ndim: int | None = None) -> np.ndarray:
    """Read a whole IDX file (plain or gzipped) into a native-endian NumPy array.

    Args:
        path: the file to read.
        ndim: if given, the number of dimensions the file must have
            (3 for images, 1 for labels).

    Raises:
        DataError: bad magic, unexpected rank, or a payload whose size does
            not match the header (truncated or padded file).
    """
    dtype, shape, header_len = _parse_idx_header(path, _read_all(path, limit=4 + 4 * 255))
    promised = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if promised > MAX_IDX_BYTES:  # a gzip of a few MB can hold gigabytes: its header says how many, before reading
        raise DataError(
            f"{path}'s header promises {promised / 2**30:,.1f} GiB of data, more than any IDX dataset fedaudit reads "
            f"({MAX_IDX_BYTES / 2**30:,.0f} GiB); it is not MNIST's or Fashion-MNIST's, get it again."
        )
    payload = _read_all(path, limit=header_len + promised + 1)  # one byte more shows a padded file
    if ndim is not None and len(shape) != ndim:
        raise DataError(
            f"{path} holds a {len(shape)}-dimensional IDX array where {ndim} dimensions were expected; "
            "check that the file names were not swapped."
        )
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(payload) - header_len
    if actual != expected:
        raise DataError(
            f"{path} has the wrong size ({actual} data bytes where its header promises {expected}); "
            "the file is truncated or corrupt, delete it and get it again."
        )
    array = np.frombuffer(payload, dtype=dtype, offset=header_len).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=True)


def _latin1_encode(obj: object, encoding: str = "utf-8") -> bytes:
    """Stand-in for ``_codecs.encode`` doing only what pickle protocol 2 uses it for (bytes as latin-1 text)."""
    if not isinstance(obj, str) or encoding.lower().replace("-", "").replace("_", "") not in {"latin1", "iso88591"}:
        raise _Refused("_codecs.encode is only allowed for latin-1 text")
    return obj.encode("latin-1")


def _numpy_attr(module: str, name: str) -> Callable[..., Any]:
    """Resolve one of NumPy's array reconstruction helpers on NumPy 1.x and 2.x alike."""
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # NumPy 1.x
        from numpy.core import multiarray, numeric  # type: ignore[no-redef]
    return getattr(multiarray if module.endswith("multiarray") else numeric, name)


class _Refused(pickle.UnpicklingError):
    """The pickle asked for something outside the allow-list."""


class _BatchUnpickler(pickle.Unpickler):
    """Unpickler for CIFAR-10 batches that refuses every global except array reconstruction."""

    _ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
        ("numpy", "ndarray"): lambda: np.ndarray,
        ("numpy", "dtype"): lambda: np.dtype,
        ("numpy.core.multiarray", "_reconstruct"): lambda: _numpy_attr("multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"): lambda: _numpy_attr("multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"): lambda: _numpy_attr("numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"): lambda: _numpy_attr("numeric", "_frombuffer"),
        ("_codecs", "encode"): lambda: _latin1_encode,
    }

    def find_class(self, module: str, name: str) -> Any:
        """Return an allow-listed global or refuse the pickle."""
        factory = self._ALLOWED.get((module, name))
        if factory is None:
            raise _Refused(f"global {module}.{name} is not allowed in a CIFAR-10 batch")
        return factory()

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent references; CIFAR-10 batches never contain them."""
        raise _Refused("persistent references are not allowed in a CIFAR-10 batch")


def read_cifar10_batch(path: PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 python batch (``data_batch_N`` or ``test_batch``).

    Returns:
        ``(images, labels)``: uint8 ``[n, 3, 32, 32]`` and int64 ``[n]``.

    Raises:
        DataError: the file is unreadable, not a CIFAR-10 batch, or contains
            anything beyond plain data (refused before it can execute).
    """
    payload = _read_all(path)
    try:
        batch = _BatchUnpickler(io.BytesIO(payload), encoding="bytes").load()
    except _Refused as exc:
        raise DataError(
            f"{path} was refused as a CIFAR-10 batch ({exc}); it is corrupt or not the official file, "
            "delete it and get it again."
        ) from exc
    except Exception as exc:  # any other failure to parse untrusted bytes means a damaged file
        raise DataError(
            f"{path} is not a readable CIFAR-10 batch (truncated or corrupt pickle); delete it and get it again."
        ) from exc
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path} is not a CIFAR-10 batch (no b'data'/b'labels' entries); delete it and get it again.")
    data, labels = batch[b"data"], batch[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _CIFAR_PIXELS:
        raise DataError(
            f"{path} has malformed image data (expected a uint8 array of shape [n, {_CIFAR_PIXELS}]); "
            "delete it and get it again."
        )
    try:
        label_array = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise DataError(f"{path} has non-integer labels; delete it and get it again.") from exc
    if label_array.shape != (data.shape[0],):
        raise DataError(f"{path} has {label_array.size} labels for {data.shape[0]} images; delete it and get it again.")
    if label_array.size and (label_array.min() < 0 or label_array.max() > 9):
        raise DataError(f"{path} has labels outside 0..9; delete it and get it again.")
    return np.ascontiguousarray(data.reshape(-1, 3, 32, 32)), label_array


def fingerprint_arrays(arrays: list[np.ndarray]) -> str:
    """SHA-256 of the raw arrays in a machine-independent encoding (dtype, shape, little-endian bytes)."""
    digest = hashlib.sha256()
    for array in arrays:
        canonical = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        digest.update(f"{canonical.dtype.str}{canonical.shape};".encode())
        digest.update(canonical.reshape(-1).view(np.uint8))  # the same bytes as tobytes(), without a copy
    return digest.hexdigest()

"""Your own data: ``npz:PATH``, ``csv:PATH`` (with a label column) and ``folder:DIR`` (one sub-folder of images per
class), read into the same :class:`~fedaudit.data.registry.Dataset` as the built-in datasets.

- ``npz:PATH``: arrays ``x`` and ``y`` and, optionally, ``x_test`` and ``y_test``, read with ``allow_pickle=False``
  (a pickled or object array is refused, never loaded). ``x`` is images ``[N, C, H, W]`` or ``[N, H, W]`` or tabular
  records ``[N, F]``.
- ``csv:PATH``: numeric tabular records, one per row, with a header; ``--label-column`` names the label column,
  every other column is a feature.
- ``folder:DIR``: ``DIR/<class>/<image>`` PNG or JPEG images, read with Pillow, converted to grey (when every image
  is grey) or RGB and resized to ``--image-size``; classes are the sub-folders in sorted order.

Labels must be integers (a folder's are its sub-folders); the distinct labels of the training split, sorted, become
classes 0..K-1. Without a test split, a stratified 20% of the records is held out for testing with a fixed seed (as
for digits). Features are standardised with the training split's own mean and standard deviation (per channel for
images, per column for tabular records). The fingerprint is a hash of the raw arrays, so a run records exactly which
data it was trained on. Every problem is one sentence naming the file (docs/your-data.md).
"""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from fedaudit.arrays import ARCHIVE_ERRORS, member_bytes, read_members
from fedaudit.data.readers import DataError, fingerprint_arrays

KINDS = ("npz", "csv", "folder")
TEST_FRACTION = 0.2
SPLIT_SEED = 0
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
DEFAULT_IMAGE_SIZE = 32
MAX_IMAGE_SIZE = 512
MAX_IMAGE_PIXELS = 64_000_000  # one image of the folder at most (a 30000 x 30000 PNG is a decompression bomb)
CSV_BYTES_PER_BYTE = 8  # what pandas holds per byte of CSV text at most (float64 cells, short numbers)
NPZ_MAGIC = b"PK\x03\x04"  # an .npz is a zip archive of .npy files
NPZ_KEYS = ("x", "y", "x_test", "y_test")  # the arrays an .npz of records may hold; nothing else is read
MAX_LABEL = 2**31 - 1  # a class number; larger ones are not one (and int64 would merge those past 2**63)


def memory_budget() -> int:
    """Bytes a dataset may take once read: half the memory the system has available now (all of it would leave
    nothing to train with)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 1 << 34


def _within_memory(path: Path, need: int, what: str) -> None:
    """Refuse, before reading, data that would need more than :func:`memory_budget` once read."""
    budget = memory_budget()
    if need > budget:
        raise DataError(
            f"{path}: {what} would need {need / 1e9:.3g} GB of memory once read, more than the "
            f"{budget / 1e9:.3g} GB fedaudit allows itself here (half of what is available)."
        )


def is_user_dataset(name: str) -> bool:
    """Whether ``name`` names the user's own data (``npz:``, ``csv:`` or ``folder:``)."""
    kind, sep, _ = str(name).partition(":")
    return bool(sep) and kind.strip().lower() in KINDS


def parse(name: str) -> tuple[str, Path]:
    """``(kind, path)`` of a ``KIND:PATH`` dataset name."""
    kind, _, rest = str(name).partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS or not rest.strip():
        raise DataError(f"--dataset {name!r} must be npz:PATH, csv:PATH or folder:DIR.")
    return kind, Path(rest.strip()).expanduser()


def read_user_dataset(
    name: str, *, label_column: str | None = None, image_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str, str]:
    """The raw arrays (train x, y, test x, y), the source and the fingerprint of a user dataset; x is float32
    ``[N, C, H, W]`` before standardisation (tabular records are ``[N, 1, 1, F]``), y int64 classes 0..K-1."""
    x, y, x_test, y_test, source, fingerprint = read_records(name, label_column=label_column, image_size=image_size)
    y, y_test = _classes(Path(source), y, y_test)
    return x, y, x_test, y_test, source, fingerprint


def read_records(
    name: str, *, label_column: str | None = None, image_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str, str]:
    """As :func:`read_user_dataset`, with the labels as the file gives them (integers, not renumbered): a site of a
    federation keeps the class numbers that every site shares."""
    kind, path = parse(name)
    if kind == "csv":
        x, y, x_test, y_test = _read_csv(path, label_column)
    elif label_column is not None:
        raise DataError("--label-column is for --dataset csv:PATH only.")
    elif kind == "npz":
        x, y, x_test, y_test = _read_npz(path)
    else:
        x, y, x_test, y_test = _read_folder(path, DEFAULT_IMAGE_SIZE if image_size is None else image_size)
    if kind != "folder" and image_size is not None:
        raise DataError("--image-size is for --dataset folder:DIR only.")
    fingerprint = fingerprint_arrays([x, y] + ([x_test, y_test] if x_test is not None else []))
    x, y, x_test, y_test = _split(path, x, y, x_test, y_test)
    return x, y, x_test, y_test, str(path.absolute()), fingerprint


def standardise(train: np.ndarray, test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Both splits standardised with the training split's mean and standard deviation per channel (images) or per
    feature (tabular records, ``H = W = 1``); a constant channel is only centred."""
    axes = (0, 1, 2) if train.shape[1] == train.shape[2] == 1 else (0, 2, 3)
    mean = train.mean(axis=axes, keepdims=True, dtype=np.float64)
    std = train.std(axis=axes, keepdims=True, dtype=np.float64)
    std[std == 0] = 1.0
    mean, std = mean.astype(np.float32), std.astype(np.float32)
    return torch.from_numpy((train - mean) / std), torch.from_numpy((test - mean) / std)


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    if not path.is_file():
        raise DataError(f"--dataset npz:{path}: the file does not exist.")
    with path.open("rb") as handle:
        magic = handle.read(len(NPZ_MAGIC))
    if magic != NPZ_MAGIC:
        kind = "a single .npy array" if magic.startswith(b"\x93NUM") else "not a zip archive"
        raise DataError(f"{path} is not an .npz file ({kind}); save the arrays with numpy.savez(path, x=..., y=...).")
    _within_memory(path, _npz_bytes(path), "its arrays")
    try:
        arrays = read_members(path, NPZ_KEYS)
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise DataError(
                f"{path} holds a pickled (object) array, which fedaudit never loads; save plain numeric arrays "
                "(ragged lists become object arrays: pad or stack them first)."
            ) from exc
        raise DataError(f"{path} is not a readable .npz file ({exc}).") from exc
    except (OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError) as exc:
        raise DataError(f"{path} is not a readable .npz file ({type(exc).__name__}: {exc}).") from exc
    missing = [key for key in ("x", "y") if key not in arrays]
    if missing:
        raise DataError(f"{path} has no array {missing[0]!r}; it needs x and y (and may hold x_test and y_test).")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path} holds only one of x_test and y_test; give both or neither.")
    x = _images(path, "x", arrays["x"])
    y = _labels(path, "y", arrays["y"], len(x))
    if "x_test" not in arrays:
        return x, y, None, None
    x_test = _images(path, "x_test", arrays["x_test"])
    if x_test.shape[1:] != x.shape[1:]:
        raise DataError(f"{path}: x_test's records have shape {x_test.shape[1:]} but x's have {x.shape[1:]}.")
    return x, y, x_test, _labels(path, "y_test", arrays["y_test"], len(x_test))


def _npz_bytes(path: Path) -> int:
    """The bytes the arrays of an .npz take once loaded (and once more as float32), and every other member's
    uncompressed size, read without decompressing any data: a compressed bomb is refused unread."""
    try:
        sizes = member_bytes(path)
    except ARCHIVE_ERRORS as exc:
        raise DataError(f"{path} is not a readable .npz file ({type(exc).__name__}: {exc}).") from exc
    return sum(size + 4 * max(count, 0) for size, count in sizes.values())


def _images(path: Path, key: str, array: np.ndarray) -> np.ndarray:
    """An npz array of records as float32 [N, C, H, W]."""
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_) or np.iscomplexobj(array):
        raise DataError(f"{path}: {key} holds {array.dtype} values; fedaudit needs real numbers.")
    if array.ndim == 2:
        array = array[:, None, None, :]
    elif array.ndim == 3:
        array = array[:, None, :, :]
    elif array.ndim != 4:
        raise DataError(
            f"{path}: {key} has shape {array.shape}; expected [N, F] records or [N, H, W] / [N, C, H, W] images."
        )
    if array.shape[0] == 0 or 0 in array.shape[1:]:
        raise DataError(f"{path}: {key} is empty (shape {array.shape}).")
    values = array.astype(np.float32)
    if not np.isfinite(values).all():
        raise DataError(f"{path}: {key} holds NaN or infinite values.")
    return values


def _labels(path: Path, key: str, array: np.ndarray, count: int) -> np.ndarray:
    """Integral labels, one per record."""
    array = np.asarray(array)
    if array.ndim != 1 or array.shape[0] != count:
        raise DataError(f"{path}: {key} has shape {array.shape} but there are {count} records; one label each.")
    if array.dtype == np.bool_:
        return array.astype(np.int64)
    if not np.issubdtype(array.dtype, np.number) or np.iscomplexobj(array):
        raise DataError(f"{path}: {key} holds {array.dtype} values; labels must be integers.")
    if not np.isfinite(array).all() or not np.array_equal(array, np.round(array)):
        raise DataError(f"{path}: {key} holds labels that are not integers.")
    if len(array) and np.abs(array.astype(np.float64)).max() > MAX_LABEL:  # 1e19 and 2e19 were one int64 class
        raise DataError(f"{path}: {key} holds a label beyond +-{MAX_LABEL:,}; labels are class numbers.")
    return array.astype(np.int64)


def _read_csv(
    path: Path, label_column: str | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    import pandas as pd

    if label_column is None:
        raise DataError(f"--dataset csv:{path} needs --label-column NAME, the column holding each record's class.")
    if not path.is_file():
        raise DataError(f"--dataset csv:{path}: the file does not exist.")
    _within_memory(path, path.stat().st_size * CSV_BYTES_PER_BYTE, "its records")
    try:
        frame = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as exc:
        raise DataError(f"{path} is not a readable CSV file ({str(exc).splitlines()[0]}).") from exc
    if label_column not in frame.columns:
        shown = ", ".join(map(str, frame.columns[:8])) + (", ..." if len(frame.columns) > 8 else "")
        raise DataError(f"{path} has no column {label_column!r} (--label-column); its columns: {shown}.")
    features = frame.drop(columns=[label_column])
    if features.shape[1] == 0 or len(frame) == 0:
        raise DataError(f"{path} has no feature columns or no rows besides the label {label_column!r}.")
    for column in features.columns:
        if not pd.api.types.is_numeric_dtype(features[column]) or pd.api.types.is_bool_dtype(features[column]):
            if not pd.api.types.is_bool_dtype(features[column]):
                raise DataError(f"{path}: column {column!r} is not numeric; encode it as numbers first.")
    labels = frame[label_column]
    if not pd.api.types.is_numeric_dtype(labels):
        raise DataError(f"{path}: the label column {label_column!r} is not numeric; labels must be integers.")
    missing = frame.isna().to_numpy()
    if missing.any():
        row, column = np.argwhere(missing)[0]
        raise DataError(
            f"{path} has empty or NaN cells (the first: row {row + 1}, column {frame.columns[column]!r}); fill or "
            "drop them first."
        )
    x = _images(path, "the features", features.to_numpy(dtype=np.float64))
    return x, _labels(path, f"the label column {label_column!r}", labels.to_numpy(), len(x)), None, None


def _read_folder(path: Path, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    from PIL import Image, UnidentifiedImageError

    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_IMAGE_SIZE:
        raise DataError(f"--image-size must be an integer from 1 to {MAX_IMAGE_SIZE}, got {size!r}.")
    if not path.is_dir():
        raise DataError(f"--dataset folder:{path}: the folder does not exist.")
    classes = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        raise DataError(f"{path} must hold one sub-folder of images per class, at least two; found {len(classes)}.")
    files: list[tuple[Path, int]] = []
    for label, folder in enumerate(classes):
        images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise DataError(f"The class folder {folder} holds no PNG or JPEG image.")
        files += [(image, label) for image in images]
    modes = [_image_mode(file) for file, _ in files]  # headers only: nothing decoded yet
    grey = all(mode in ("L", "1", "I", "I;16", "F") for mode in modes)
    mode, channels = ("L", 1) if grey else ("RGB", 3)
    _within_memory(path, len(files) * channels * size * size * 4, f"{len(files)} images at {size} x {size}")
    x = np.empty((len(files), channels, size, size), dtype=np.float32)
    for i, (file, _) in enumerate(files):  # one full-size image in memory at a time
        try:
            with Image.open(file) as image:
                resized = image.convert(mode).resize((size, size), Image.Resampling.BILINEAR)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise DataError(f"{file} is not a readable image ({type(exc).__name__}).") from exc
        pixels = np.asarray(resized, dtype=np.float32) / 255.0
        x[i] = pixels[None] if grey else pixels.transpose(2, 0, 1)
    return x, np.array([label for _, label in files], dtype=np.int64), None, None


def _image_mode(file: Path) -> str:
    """An image's mode from its header, refused before it is decoded when it is not an image or has more than
    :data:`MAX_IMAGE_PIXELS` pixels."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as image:
            width, height = image.size
            mode = image.mode
    except Image.DecompressionBombError as exc:  # Pillow's own limit, above ours: its sentence gives the size
        raise DataError(f"{file} has more pixels than fedaudit decodes per image ({exc}).") from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DataError(f"{file} is not a readable image ({type(exc).__name__}).") from exc
    if width * height > MAX_IMAGE_PIXELS:
        raise DataError(
            f"{file} is {width} x {height} pixels, more than the {MAX_IMAGE_PIXELS:,} fedaudit decodes per image; "
            "shrink it first."
        )
    return mode


def _split(
    path: Path, x: np.ndarray, y: np.ndarray, x_test: np.ndarray | None, y_test: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The given test split, or a stratified 20% of the records (fixed seed)."""
    if x_test is not None and y_test is not None:
        return x, y, x_test, y_test
    values, counts = np.unique(y, return_counts=True)
    n_test = math.ceil(TEST_FRACTION * len(y))
    if len(y) < 10 or counts.min() < 2 or min(n_test, len(y) - n_test) < len(values):
        raise DataError(
            f"{path} has too few records to hold out a test split ({len(y)} records in {len(values)} classes, the "
            f"smallest with {counts.min()}); give x_test and y_test, or more records (at least 2 per class and 5 "
            "times as many records as classes)."
        )
    train, test = stratified_split(y, n_test, SPLIT_SEED)
    return x[train], y[train], x[test], y[test]


def stratified_split(y: np.ndarray, n_test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test positions of scikit-learn's ``train_test_split(test_size=n_test, stratify=y,
    random_state=seed)``, drawn as its StratifiedShuffleSplit draws them (the same RandomState calls in the same
    order), without importing scikit-learn: its import takes over a second, which every Flower ClientApp process of
    a site that keeps its records paid on every message. A test holds it to scikit-learn's own split."""
    rng = np.random.RandomState(seed)
    _, inverse, counts = np.unique(y, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse.reshape(-1), kind="stable"), np.cumsum(counts)[:-1])
    in_train = _approximate_mode(counts, len(y) - n_test, rng)
    in_test = _approximate_mode(counts - in_train, n_test, rng)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for members, count, k, t in zip(by_class, counts, in_train, in_test):
        shuffled = members[rng.permutation(count)]
        train.append(shuffled[:k])
        test.append(shuffled[k : k + t])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``draws`` records each class gives: its share of ``draws`` rounded down, then one more for the
    classes with the largest remainders, ties broken at random (scikit-learn's ``_approximate_mode``)."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    missing = int(draws - floored.sum())
    if missing > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            now = min(len(tied), missing)
            floored[rng.choice(tied, size=now, replace=False)] += 1
            missing -= now
            if missing == 0:
                break
    return floored.astype(int)


def _classes(path: Path, y: np.ndarray, y_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels as classes 0..K-1 in the sorted order of the training split's distinct labels."""
    values = np.unique(y)
    if len(values) < 2:
        raise DataError(f"{path} has a single class in its training records; membership needs at least two.")
    unknown = np.setdiff1d(np.unique(y_test), values)
    if unknown.size:
        raise DataError(f"{path}: the test split has label {unknown[0]}, which no training record has.")
    return np.searchsorted(values, y).astype(np.int64), np.searchsorted(values, y_test).astype(np.int64)

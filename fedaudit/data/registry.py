"""The dataset registry: where each dataset's files live, how to read and normalise them.

Four datasets are known. ``digits`` (scikit-learn's bundled 8x8 digits) is
always available and is the default; ``mnist``, ``fashion-mnist`` and
``cifar10`` are read from their raw files, found in ``data_dir`` or, without
one, in ``$FEDAUDIT_DATA_DIR`` and ``/usr/share/datasets/<name>`` (where
Debian's ``dataset-fashion-mnist`` package installs Fashion-MNIST). Nothing is
downloaded unless the caller asks for it, and then only through torchvision.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedaudit.data.readers import DataError, fingerprint_arrays, read_cifar10_batch, read_idx, read_idx_shape
from fedaudit.data.user import is_user_dataset, parse, read_user_dataset, standardise

if TYPE_CHECKING:
    import pandas as pd  # imported where used: every Flower ClientApp process imports this module

__all__ = [
    "DATASET_NAMES",
    "DEFAULT_DATASET",
    "DataError",
    "Dataset",
    "dataset_table",
    "load_dataset",
    "locate_dataset",
]

DATASET_NAMES: tuple[str, ...] = ("digits", "mnist", "fashion-mnist", "cifar10")
DEFAULT_DATASET = "digits"

ENV_DATA_DIR = "FEDAUDIT_DATA_DIR"
SYSTEM_DATA_DIR = Path("/usr/share/datasets")
BUNDLED_SOURCE = "scikit-learn (bundled)"

DIGITS_SPLIT_FILE = Path(__file__).with_name("digits_split.npz")
"""The digits train/test split: the record positions of scikit-learn's ``train_test_split(test_size=0.2,
stratify=labels, random_state=0)``, in its order (tests check it against scikit-learn)."""
_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
_DOWNLOAD_HINT = "use --download with torchvision installed"


@dataclass(frozen=True)
class _Spec:
    """Static facts about one dataset: files, layout, sizes and normalisation constants."""

    name: str
    title: str
    shape: tuple[int, int, int]
    num_classes: int
    train_size: int
    test_size: int
    pixel_scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    torchvision_dir: str | None
    torchvision_class: str | None
    files: tuple[str, ...]
    gz_allowed: bool
    files_phrase: str
    how_to_get: str


_SPECS: dict[str, _Spec] = {
    "digits": _Spec(
        name="digits",
        title="digits",
        shape=(1, 8, 8),
        num_classes=10,
        train_size=1437,
        test_size=360,
        pixel_scale=16.0,
        mean=(0.3054,),  # of the train split / 16, computed once from sklearn.datasets.load_digits
        std=(0.3761,),
        torchvision_dir=None,
        torchvision_class=None,
        files=(),
        gz_allowed=False,
        files_phrase="",
        how_to_get="",
    ),
    "mnist": _Spec(
        name="mnist",
        title="MNIST",
        shape=(1, 28, 28),
        num_classes=10,
        train_size=60000,
        test_size=10000,
        pixel_scale=255.0,
        mean=(0.1307,),
        std=(0.3081,),
        torchvision_dir="MNIST/raw",
        torchvision_class="MNIST",
        files=_IDX_FILES,
        gz_allowed=True,
        files_phrase="train-images-idx3-ubyte[.gz] (and the other three IDX files)",
        how_to_get=f"pass --data-dir pointing at a copy or {_DOWNLOAD_HINT}",
    ),
    "fashion-mnist": _Spec(
        name="fashion-mnist",
        title="Fashion-MNIST",
        shape=(1, 28, 28),
        num_classes=10,
        train_size=60000,
        test_size=10000,
        pixel_scale=255.0,
        mean=(0.2860,),
        std=(0.3530,),
        torchvision_dir="FashionMNIST/raw",
        torchvision_class="FashionMNIST",
        files=_IDX_FILES,
        gz_allowed=True,
        files_phrase="train-images-idx3-ubyte[.gz] (and the other three IDX files)",
        how_to_get=f"install Debian's dataset-fashion-mnist, pass --data-dir, or {_DOWNLOAD_HINT}",
    ),
    "cifar10": _Spec(
        name="cifar10",
        title="CIFAR-10",
        shape=(3, 32, 32),
        num_classes=10,
        train_size=50000,
        test_size=10000,
        pixel_scale=255.0,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        torchvision_dir="cifar-10-batches-py",
        torchvision_class="CIFAR10",
        files=_CIFAR_FILES,
        gz_allowed=False,
        files_phrase="data_batch_1 to data_batch_5 and test_batch (the python version)",
        how_to_get=f"pass --data-dir pointing at a copy of cifar-10-batches-py or {_DOWNLOAD_HINT}",
    ),
}


@dataclass(frozen=True, eq=False)
class Dataset:
    """A loaded, normalised dataset with a fixed train/test split.

    Images are float32 ``[N, C, H, W]`` scaled to [0, 1] and then normalised
    per channel with the dataset's fixed mean/std constants; labels are int64.
    ``fingerprint`` identifies the raw data (before normalisation) so a run
    directory can record exactly which data it was trained on.
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    source: str
    fingerprint: str
    # a federation whose sites keep their records: each site's number of test records, in client order (the test
    # split is theirs one after the other, and the model is evaluated site by site, as at the sites themselves)
    test_sites: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Check the tensors agree with each other, so downstream code can rely on it."""
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if x.dtype != torch.float32 or x.ndim != 4:
                raise ValueError(f"{split}_x must be a float32 tensor [N, C, H, W], got {x.dtype} {tuple(x.shape)}")
            if y.dtype != torch.int64 or y.shape != (x.shape[0],):
                raise ValueError(f"{split}_y must be an int64 tensor [{x.shape[0]}], got {y.dtype} {tuple(y.shape)}")
        if self.train_x.shape[1:] != self.test_x.shape[1:]:
            raise ValueError("train_x and test_x must have the same image shape")
        if self.test_sites and sum(self.test_sites) != self.test_x.shape[0]:
            raise ValueError("test_sites must split the whole test split")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The shape of one image, ``(C, H, W)``."""
        channels, height, width = self.train_x.shape[1:]
        return int(channels), int(height), int(width)

    def __repr__(self) -> str:
        """Summarise without printing tensors."""
        return (
            f"Dataset(name={self.name!r}, train={len(self.train_y)}, test={len(self.test_y)}, "
            f"shape={self.input_shape}, num_classes={self.num_classes}, source={self.source!r}, "
            f"fingerprint={self.fingerprint[:12]}...)"
        )


def _spec(name: str) -> _Spec:
    """Look a dataset up by name (case-insensitive, ``_`` read as ``-``)."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in _SPECS:
        raise DataError(f"unknown dataset {name!r}: choose one of {', '.join(DATASET_NAMES)}.")
    return _SPECS[key]


def _roots(data_dir: str | os.PathLike[str] | None) -> list[Path]:
    """The root directories searched, in order: ``data_dir`` alone, else ``$FEDAUDIT_DATA_DIR``."""
    if data_dir is not None:
        return [Path(data_dir).expanduser().absolute()]
    env = os.environ.get(ENV_DATA_DIR, "").strip()
    return [Path(env).expanduser().absolute()] if env else []


def _candidates(spec: _Spec, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    """Every directory that may hold ``spec``'s files, most specific layout first."""
    dirs: list[Path] = []
    for root in _roots(data_dir):
        if spec.torchvision_dir is not None:
            dirs.append(root / spec.torchvision_dir)
        dirs += [root / spec.name, root]
    if data_dir is None:
        dirs.append(SYSTEM_DATA_DIR / spec.name)
    return dirs


def _find_file(directory: Path, base: str, gz_allowed: bool) -> Path | None:
    """Return ``directory/base`` or, if allowed, ``directory/base.gz``; plain files win."""
    for candidate in (base, base + ".gz") if gz_allowed else (base,):
        path = directory / candidate
        if path.is_file():
            return path
    return None


def _files_in(spec: _Spec, directory: Path) -> dict[str, Path | None]:
    """Map each required file name to where it is in ``directory`` (None when absent)."""
    return {base: _find_file(directory, base, spec.gz_allowed) for base in spec.files}


def _required_files(spec: _Spec, directory: Path) -> dict[str, Path]:
    """The paths of all of ``spec``'s files in ``directory``; DataError naming the first one missing."""
    found: dict[str, Path] = {}
    for base, path in _files_in(spec, directory).items():
        if path is None:
            suffix = "[.gz]" if spec.gz_allowed else ""
            raise DataError(
                f"{spec.title} is incomplete: expected {base}{suffix} in {directory} next to the other files; "
                f"{spec.how_to_get}."
            )
        found[base] = path
    return found


def locate_dataset(name: str, data_dir: str | None = None) -> str | None:
    """Return the directory holding ``name``'s raw files, or None if it is not found.

    ``data_dir`` may be a torchvision root (``ROOT/MNIST/raw``,
    ``ROOT/FashionMNIST/raw``, ``ROOT/cifar-10-batches-py``), ``ROOT/<name>``
    or a flat directory holding the files. Without ``data_dir`` the same
    layouts are tried under ``$FEDAUDIT_DATA_DIR``, then
    ``/usr/share/datasets/<name>``. ``digits`` is bundled and always found.
    """
    spec = _spec(name)
    if not spec.files:
        return BUNDLED_SOURCE
    for directory in _candidates(spec, data_dir):
        if all(path is not None for path in _files_in(spec, directory).values()):
            return str(directory)
    return None


def _not_found_error(spec: _Spec, data_dir: str | os.PathLike[str] | None) -> DataError:
    """Build the one-sentence error for a dataset whose files are missing."""
    candidates = _candidates(spec, data_dir)
    for directory in candidates:
        if any(path is not None for path in _files_in(spec, directory).values()):
            try:
                _required_files(spec, directory)
            except DataError as incomplete:
                return incomplete
    where = ", ".join(str(d) for d in candidates[:-1])
    where = f"{where} or {candidates[-1]}" if where else str(candidates[-1])
    if data_dir is not None and not Path(data_dir).expanduser().is_dir():
        where += f" (and {Path(data_dir).expanduser().absolute()} does not exist)"
    return DataError(f"{spec.title} not found: expected {spec.files_phrase} in {where}; {spec.how_to_get}.")


def _download(spec: _Spec, data_dir: str | os.PathLike[str] | None) -> None:
    """Download ``spec`` into ``data_dir`` (torchvision layout) with torchvision."""
    try:
        import torchvision  # noqa: PLC0415 - optional dependency, imported only when asked to download
    except ImportError as exc:
        raise DataError("--download needs torchvision (pip install 'fedaudit[vision]').") from exc
    roots = _roots(data_dir)
    if not roots:
        raise DataError(f"--download needs --data-dir (or ${ENV_DATA_DIR}) to say where to put {spec.title}.")
    root = roots[0]
    dataset_class: Callable[..., object] = getattr(torchvision.datasets, str(spec.torchvision_class))
    try:
        root.mkdir(parents=True, exist_ok=True)
        for train in (True, False):
            dataset_class(str(root), train=train, download=True)
    except Exception as exc:  # torchvision raises many kinds (URLError, RuntimeError, OSError, ...)
        raise DataError(
            f"downloading {spec.title} into {root} failed ({exc}); check the network or copy the files there."
        ) from exc


def _normalise(raw: np.ndarray, spec: _Spec) -> torch.Tensor:
    """Scale raw pixels to [0, 1], then standardise each channel with the dataset's constants."""
    images = torch.from_numpy(raw).to(torch.float32).div_(spec.pixel_scale)
    mean = torch.tensor(spec.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(spec.std, dtype=torch.float32).view(1, -1, 1, 1)
    return images.sub_(mean).div_(std)


def _read_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """scikit-learn's bundled digits as uint8 images 0..16, with the fixed stratified 80/20 split.

    Read from scikit-learn's own file (``load_digits`` reads the same) without importing scikit-learn, whose import
    is about a second of start-up in every process that loads digits: each command and each Flower ClientApp.
    """
    package = importlib.util.find_spec("sklearn")
    if package is None:
        raise DataError(
            "the digits dataset comes with scikit-learn, which is not installed (pip install scikit-learn)."
        )
    locations = list(package.submodule_search_locations or [])
    path = Path(locations[0]) / "datasets" / "data" / "digits.csv.gz" if locations else None
    if path is not None and path.is_file():
        table = np.loadtxt(path, delimiter=",")
        images = table[:, :-1].astype(np.uint8).reshape(-1, 8, 8)[:, None, :, :]  # load_digits' layout (strides)
        labels = table[:, -1].astype(np.int64)
    else:  # a scikit-learn that keeps the file elsewhere: its own reader
        from sklearn.datasets import load_digits  # noqa: PLC0415

        bunch = load_digits()
        images, labels = bunch.images.astype(np.uint8)[:, None, :, :], bunch.target.astype(np.int64)
    with np.load(DIGITS_SPLIT_FILE) as split:
        train, test = split["train"].astype(np.int64), split["test"].astype(np.int64)
    return images[train], labels[train], images[test], labels[test], BUNDLED_SOURCE


def _read_idx_dataset(spec: _Spec, directory: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """Read the four IDX files of an MNIST-style dataset and check they fit together."""
    files = _required_files(spec, directory)
    splits: list[np.ndarray] = []
    for split in ("train", "t10k"):
        image_path = files[f"{split}-images-idx3-ubyte"]
        label_path = files[f"{split}-labels-idx1-ubyte"]
        images = read_idx(image_path, ndim=3)
        labels = read_idx(label_path, ndim=1)
        if images.dtype != np.uint8 or images.shape[1:] != spec.shape[1:]:
            raise DataError(
                f"{image_path} holds {images.dtype} images of size {images.shape[1:]} where uint8 "
                f"{spec.shape[1]}x{spec.shape[2]} images were expected; it is not a {spec.title} file."
            )
        if labels.shape[0] != images.shape[0]:
            raise DataError(
                f"{label_path} has {labels.shape[0]} labels but {image_path} has {images.shape[0]} images; "
                "one of them is from another dataset or damaged, get both again."
            )
        if labels.size and (labels.min() < 0 or labels.max() >= spec.num_classes):
            raise DataError(
                f"{label_path} has labels outside 0..{spec.num_classes - 1}; it is not a {spec.title} file."
            )
        splits += [images[:, None, :, :], labels.astype(np.int64)]
    return splits[0], splits[1], splits[2], splits[3], str(directory)


def _read_cifar10(spec: _Spec, directory: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """Read the five CIFAR-10 training batches and the test batch."""
    batches = [read_cifar10_batch(path) for path in _required_files(spec, directory).values()]
    train_x = np.concatenate([images for images, _ in batches[:-1]])
    train_y = np.concatenate([labels for _, labels in batches[:-1]])
    test_x, test_y = batches[-1]
    return train_x, train_y, test_x, test_y, str(directory)


def load_dataset(
    name: str,
    data_dir: str | None = None,
    download: bool = False,
    *,
    label_column: str | None = None,
    image_size: int | None = None,
) -> Dataset:
    """Load a dataset by name, normalised, with its fixed train/test split.

    Args:
        name: one of :data:`DATASET_NAMES`, or the user's own data: ``npz:PATH``, ``csv:PATH`` or ``folder:DIR``
            (:mod:`fedaudit.data.user`; ``label_column`` and ``image_size`` are theirs).
        data_dir: where to look (see :func:`locate_dataset`); also where
            ``download`` puts files.
        download: if the files are not found, fetch them with torchvision
            (an optional dependency). Nothing is downloaded otherwise.

    Raises:
        DataError: unknown name, files missing or corrupt, or download impossible.

    Example:
        >>> ds = load_dataset("digits")
        >>> ds.input_shape, ds.num_classes
        ((1, 8, 8), 10)
    """
    if is_user_dataset(name):
        if data_dir is not None or download:
            raise DataError(
                "--data-dir and --download are for the built-in datasets, not --dataset npz:, csv:, folder:."
            )
        train_x, train_y, test_x, test_y, source, fingerprint = read_user_dataset(
            name, label_column=label_column, image_size=image_size
        )
        train, test = standardise(train_x, test_x)
        return Dataset(
            name=str(name).strip(),
            train_x=train,
            train_y=torch.from_numpy(train_y),
            test_x=test,
            test_y=torch.from_numpy(test_y),
            num_classes=int(train_y.max()) + 1,
            source=source,
            fingerprint=fingerprint,
        )
    if label_column is not None or image_size is not None:
        raise DataError("--label-column and --image-size are for --dataset csv:PATH and folder:DIR only.")
    spec = _spec(name)
    if not spec.files:
        raw = _read_digits()
    else:
        location = locate_dataset(spec.name, data_dir)
        if location is None and download:
            _download(spec, data_dir)
            location = locate_dataset(spec.name, data_dir)
        if location is None:
            raise _not_found_error(spec, data_dir)
        reader = _read_cifar10 if spec.name == "cifar10" else _read_idx_dataset
        raw = reader(spec, Path(location))
    train_x, train_y, test_x, test_y, source = raw
    return Dataset(
        name=spec.name,
        train_x=_normalise(train_x, spec),
        train_y=torch.from_numpy(np.ascontiguousarray(train_y, dtype=np.int64)),
        test_x=_normalise(test_x, spec),
        test_y=torch.from_numpy(np.ascontiguousarray(test_y, dtype=np.int64)),
        num_classes=spec.num_classes,
        source=source,
        fingerprint=fingerprint_arrays([train_x, train_y, test_x, test_y]),
    )


def _counts(spec: _Spec, location: str) -> tuple[int, int]:
    """Train/test sizes without loading: IDX headers, or the known sizes otherwise."""
    if spec.gz_allowed:
        files = _required_files(spec, Path(location))
        return read_idx_shape(files["train-images-idx3-ubyte"])[0], read_idx_shape(files["t10k-images-idx3-ubyte"])[0]
    return spec.train_size, spec.test_size


def dataset_table(data_dir: str | None = None) -> pd.DataFrame:
    """One row per known dataset: where it was found, its sizes, and how to get it if missing.

    Sizes come from IDX headers or known constants; nothing large is loaded.
    A found dataset whose header is unreadable gets empty sizes and the
    problem in ``how_to_get``.
    """
    import pandas as pd  # noqa: PLC0415 - see the module's imports

    rows = []
    for name in DATASET_NAMES:
        spec = _SPECS[name]
        location = locate_dataset(name, data_dir)
        train: int | None = None
        test: int | None = None
        how_to_get = ""
        if location is None:
            how_to_get = spec.how_to_get[0].upper() + spec.how_to_get[1:] + "."
            elsewhere = locate_dataset(name) if data_dir is not None else None
            if elsewhere is not None:  # --data-dir replaces the usual places; say where it would have been found
                searched = Path(data_dir).expanduser().absolute()
                how_to_get = f"Not in {searched}, the one place --data-dir searches; found at {elsewhere} without it."
        else:
            try:
                train, test = _counts(spec, location)
            except DataError as exc:
                how_to_get = str(exc)
        rows.append(
            {
                "dataset": name,
                "found_at": location or "",
                "train": train,
                "test": test,
                "shape": "x".join(str(d) for d in spec.shape),
                "classes": spec.num_classes,
                "how_to_get": how_to_get,
            }
        )
    table = pd.DataFrame(rows)
    return table.astype({"train": "Int64", "test": "Int64"})


def dataset_text(table: pd.DataFrame) -> str:
    """The dataset table for a terminal: one short row per dataset ("-" for what is unknown), and, for a dataset
    that was not found or not readable, how to get it on its own line below."""
    import pandas as pd  # noqa: PLC0415 - see the module's imports

    header = ("dataset", "train", "test", "shape", "classes", "found at")
    rows = [
        (
            str(row.dataset),
            "-" if pd.isna(row.train) else str(int(row.train)),
            "-" if pd.isna(row.test) else str(int(row.test)),
            str(row.shape),
            str(row.classes),
            row.found_at or "not found",
        )
        for row in table.itertuples()
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = (False, True, True, False, True, False)

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(cells, widths, numeric)).rstrip()

    notes = [f"{name}: {how}" for name, how in zip(table["dataset"], table["how_to_get"]) if how]
    return "\n".join([line(header), *map(line, rows), *([""] + notes if notes else [])])


def user_dataset_row(name: str, *, label_column: str | None = None, image_size: int | None = None) -> dict[str, Any]:
    """A row of ``fedaudit datasets`` for the user's own data, read as ``train`` reads it (``label_column`` applies to
    a csv: dataset only, ``image_size`` to a folder: one)."""
    kind, _ = parse(name)
    dataset = load_dataset(
        name,
        label_column=label_column if kind == "csv" else None,
        image_size=image_size if kind == "folder" else None,
    )
    return {
        "dataset": dataset.name,
        "found_at": f"{dataset.source} (fingerprint {dataset.fingerprint[:12]})",
        "train": len(dataset.train_y),
        "test": len(dataset.test_y),
        "shape": "x".join(str(d) for d in dataset.input_shape),
        "classes": dataset.num_classes,
        "how_to_get": "",
    }

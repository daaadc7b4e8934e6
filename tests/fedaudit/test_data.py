"""Tests for fedaudit.data: readers, the dataset registry, partitioners and the membership split."""

from __future__ import annotations

import gzip
import os
import pickle
import re
import struct
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import FASHION_MNIST_DIR, fashion_mnist

from fedaudit.data import (
    DATASET_NAMES,
    DataError,
    Dataset,
    Partition,
    PartitionError,
    dataset_table,
    load_dataset,
    locate_dataset,
    partition_dataset,
    registry,
    validate_partition_spec,
)
from fedaudit.data.readers import read_cifar10_batch, read_idx, read_idx_shape

FASHION_DIR = FASHION_MNIST_DIR
IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


# --------------------------------------------------------------------------- helpers


def write_idx(path: Path, array: np.ndarray, *, gz: bool = False) -> Path:
    """Write ``array`` (uint8) as an IDX file, optionally gzipped (appending .gz)."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


def synthetic_mnist(seed: int = 0, n_train: int = 30, n_test: int = 10) -> dict[str, np.ndarray]:
    """Small random MNIST-shaped arrays keyed by IDX file name."""
    rng = np.random.default_rng(seed)
    return {
        IDX_NAMES[0]: rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        IDX_NAMES[1]: rng.integers(0, 10, n_train, dtype=np.uint8),
        IDX_NAMES[2]: rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        IDX_NAMES[3]: rng.integers(0, 10, n_test, dtype=np.uint8),
    }


def write_mnist(directory: Path, arrays: dict[str, np.ndarray], *, gz: bool = False) -> dict[str, Path]:
    """Write the four IDX files into ``directory``; return their paths by base name."""
    directory.mkdir(parents=True, exist_ok=True)
    return {name: write_idx(directory / name, array, gz=gz) for name, array in arrays.items()}


def write_cifar(directory: Path, *, per_batch: int = 4, protocol: int = 2) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Write tiny CIFAR-10 batches in the official format (dict with b'data' uint8 [n, 3072], b'labels')."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": [b"x.png"] * per_batch}
        with open(directory / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=protocol)
        written[name] = (data, labels)
    return written


def unnormalise(x: torch.Tensor, mean: float, std: float) -> np.ndarray:
    """Map normalised [0,1]-scaled pixels back to uint8 values."""
    return np.rint((x.numpy() * std + mean) * 255).astype(np.int64)


@pytest.fixture
def no_default_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Hide $FEDAUDIT_DATA_DIR and the system dataset directory from the registry."""
    monkeypatch.delenv(registry.ENV_DATA_DIR, raising=False)
    monkeypatch.setattr(registry, "SYSTEM_DATA_DIR", tmp_path / "no-system-datasets")


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


# --------------------------------------------------------------------------- digits


def test_digits_loads_with_fixed_split_and_normalisation(digits: Dataset) -> None:
    assert digits.name == "digits" and digits.source == "scikit-learn (bundled)"
    assert digits.train_x.shape == (1437, 1, 8, 8) and digits.test_x.shape == (360, 1, 8, 8)
    assert digits.train_x.dtype == torch.float32 and digits.train_y.dtype == torch.int64
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    assert torch.equal(torch.unique(digits.train_y), torch.arange(10))
    # stratified: every class has ~20% of its records in test
    test_share = torch.bincount(digits.test_y, minlength=10) / (
        torch.bincount(digits.test_y, minlength=10) + torch.bincount(digits.train_y, minlength=10)
    )
    assert torch.all((test_share - 0.2).abs() < 0.01)
    assert abs(digits.train_x.mean().item()) < 0.01 and abs(digits.train_x.std().item() - 1) < 0.01


def test_digits_are_scikit_learns_records_and_split_read_without_importing_it(digits: Dataset) -> None:
    """The records equal ``load_digits``' and the split ``train_test_split``'s (stratified, 20%, seed 0), in order;
    a fresh process that loads digits never imports scikit-learn (a second of every command's start-up)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images, labels = bunch.images.astype(np.uint8)[:, None], bunch.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(images, labels, test_size=0.2, stratify=labels, random_state=0)
    ours = registry._read_digits()
    for mine, theirs in zip(ours[:4], (train_x, train_y, test_x, test_y)):
        # the strides too: a convolution takes another kernel for another layout, and the run's floats change
        assert mine.dtype == theirs.dtype and mine.strides == theirs.strides and np.array_equal(mine, theirs)
    script = (
        "import sys; from fedaudit.data import load_dataset; load_dataset('digits'); print('sklearn' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split()[-1] == "False"


def test_digits_fall_back_to_scikit_learns_reader_where_its_file_is_elsewhere(monkeypatch, tmp_path) -> None:
    read = registry._read_digits()
    elsewhere = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: elsewhere)
    for mine, theirs in zip(registry._read_digits()[:4], read[:4]):
        assert mine.strides == theirs.strides and np.array_equal(mine, theirs)
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="comes with scikit-learn, which is not installed"):
        registry._read_digits()


def test_digits_split_and_fingerprint_do_not_depend_on_global_seeds(digits: Dataset) -> None:
    np.random.seed(123)
    torch.manual_seed(123)
    again = load_dataset("DIGITS")
    assert again.fingerprint == digits.fingerprint and len(digits.fingerprint) == 64
    assert torch.equal(again.train_y, digits.train_y) and torch.equal(again.test_x, digits.test_x)


def test_unknown_dataset_name_is_a_data_error() -> None:
    with pytest.raises(DataError, match="unknown dataset 'imagenet': choose one of digits, mnist"):
        load_dataset("imagenet")


def test_dataset_rejects_inconsistent_tensors() -> None:
    x = torch.zeros(3, 1, 8, 8)
    with pytest.raises(ValueError, match="train_y"):
        Dataset("d", x, torch.zeros(2, dtype=torch.int64), x, torch.zeros(3, dtype=torch.int64), 10, "s", "f")


# --------------------------------------------------------------------------- IDX datasets


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
@pytest.mark.parametrize("layout", ["MNIST/raw", "mnist", "."], ids=["torchvision", "named", "flat"])
def test_mnist_from_layouts(tmp_path: Path, no_default_dirs: None, layout: str, gz: bool) -> None:
    arrays = synthetic_mnist()
    write_mnist(tmp_path / "root" / layout, arrays, gz=gz)

    ds = load_dataset("mnist", data_dir=str(tmp_path / "root"))

    assert Path(ds.source) == (tmp_path / "root" / layout).absolute()
    assert locate_dataset("mnist", str(tmp_path / "root")) == ds.source
    assert ds.train_x.shape == (30, 1, 28, 28) and ds.test_x.shape == (10, 1, 28, 28)
    assert np.array_equal(unnormalise(ds.train_x[:, 0], 0.1307, 0.3081), arrays[IDX_NAMES[0]])
    assert np.array_equal(ds.test_y.numpy(), arrays[IDX_NAMES[3]])


def test_fingerprint_is_pinned_and_sensitive_to_raw_data(tmp_path: Path, no_default_dirs: None) -> None:
    arrays = {
        IDX_NAMES[0]: (np.arange(3 * 784) % 251).astype(np.uint8).reshape(3, 28, 28),
        IDX_NAMES[1]: np.array([3, 1, 4], np.uint8),
        IDX_NAMES[2]: (np.arange(2 * 784) % 7).astype(np.uint8).reshape(2, 28, 28),
        IDX_NAMES[3]: np.array([5, 9], np.uint8),
    }
    write_mnist(tmp_path / "a", arrays)
    write_mnist(tmp_path / "b", arrays, gz=True)
    arrays[IDX_NAMES[2]][0, 0, 0] ^= 1
    write_mnist(tmp_path / "c", arrays)

    a, b, c = (load_dataset("mnist", str(tmp_path / d)) for d in "abc")

    # The encoding is fixed (dtype, shape, little-endian bytes), so this value holds on every machine.
    assert a.fingerprint == "f75b6e9ed06db8dab8ba37339444600be336daf05b2f52d30d8bd47ee221dd11"
    assert b.fingerprint == a.fingerprint
    assert c.fingerprint != a.fingerprint


def test_data_dir_from_environment(tmp_path: Path, no_default_dirs: None, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mnist(tmp_path / "env" / "FashionMNIST" / "raw", synthetic_mnist(), gz=True)
    monkeypatch.setenv(registry.ENV_DATA_DIR, str(tmp_path / "env"))

    assert locate_dataset("fashion-mnist") == str((tmp_path / "env" / "FashionMNIST" / "raw").absolute())
    assert load_dataset("fashion_mnist").train_y.shape == (30,)


def _corrupt_magic(path: Path) -> None:
    path.write_bytes(b"\x12\x34" + path.read_bytes()[2:])


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _pad(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\x00" * 5)


def _bad_gzip(path: Path) -> None:
    path.write_bytes(gzip.compress(path.read_bytes())[:40])


@pytest.mark.parametrize(
    ("corrupt", "target", "message"),
    [
        (_corrupt_magic, IDX_NAMES[0], "bad magic number"),
        (_truncate, IDX_NAMES[2], "wrong size"),
        (_pad, IDX_NAMES[3], "wrong size"),
        (_bad_gzip, IDX_NAMES[1], "not a valid gzip file"),
    ],
    ids=["magic", "truncated", "padded", "gzip"],
)
def test_corrupt_idx_file_names_the_file(
    tmp_path: Path, no_default_dirs: None, corrupt: Callable[[Path], None], target: str, message: str
) -> None:
    paths = write_mnist(tmp_path, synthetic_mnist())
    corrupt(paths[target])

    with pytest.raises(DataError, match=message) as info:
        load_dataset("mnist", str(tmp_path))

    assert str(paths[target]) in str(info.value) and "\n" not in str(info.value)


def test_label_count_mismatch_names_the_label_file(tmp_path: Path, no_default_dirs: None) -> None:
    arrays = synthetic_mnist()
    arrays[IDX_NAMES[1]] = arrays[IDX_NAMES[1]][:-1]
    paths = write_mnist(tmp_path, arrays, gz=True)

    with pytest.raises(DataError, match="has 29 labels but .* has 30 images") as info:
        load_dataset("mnist", str(tmp_path))

    assert str(info.value).startswith(str(paths[IDX_NAMES[1]]))


def test_wrong_image_size_is_refused(tmp_path: Path, no_default_dirs: None) -> None:
    arrays = synthetic_mnist()
    arrays[IDX_NAMES[0]] = arrays[IDX_NAMES[0]][:, :8, :8]
    paths = write_mnist(tmp_path, arrays)

    with pytest.raises(DataError, match="28x28 images were expected") as info:
        load_dataset("mnist", str(tmp_path))

    assert str(paths[IDX_NAMES[0]]) in str(info.value)


def test_idx_reader_checks_rank_and_reads_headers_only(tmp_path: Path) -> None:
    labels = write_idx(tmp_path / "labels", np.arange(7, dtype=np.uint8), gz=True)
    assert read_idx_shape(labels) == (7,)
    assert np.array_equal(read_idx(labels, ndim=1), np.arange(7))
    with pytest.raises(DataError, match="1-dimensional IDX array where 3 dimensions were expected"):
        read_idx(labels, ndim=3)


def test_missing_directory_says_where_and_how(tmp_path: Path, no_default_dirs: None) -> None:
    missing = tmp_path / "nowhere"

    with pytest.raises(DataError) as info:
        load_dataset("fashion-mnist", str(missing))

    message = str(info.value)
    assert message.startswith("Fashion-MNIST not found: expected train-images-idx3-ubyte[.gz]")
    assert str(missing / "FashionMNIST" / "raw") in message and "does not exist" in message
    assert "dataset-fashion-mnist" in message and "--data-dir" in message and "--download" in message
    assert "\n" not in message
    assert locate_dataset("fashion-mnist", str(missing)) is None


def test_incomplete_directory_names_the_missing_file(tmp_path: Path, no_default_dirs: None) -> None:
    paths = write_mnist(tmp_path, synthetic_mnist(), gz=True)
    paths[IDX_NAMES[3]].unlink()

    with pytest.raises(DataError, match=re.escape(f"MNIST is incomplete: expected {IDX_NAMES[3]}[.gz] in {tmp_path} ")):
        load_dataset("mnist", str(tmp_path))


# --------------------------------------------------------------------------- download


def test_download_without_torchvision_is_a_data_error(
    tmp_path: Path, no_default_dirs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # makes `import torchvision` raise ImportError

    with pytest.raises(DataError, match=r"--download needs torchvision \(pip install 'fedaudit\[vision\]'\)"):
        load_dataset("mnist", str(tmp_path), download=True)


@pytest.fixture
def fake_torchvision(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Install a stand-in torchvision whose MNIST class 'downloads' synthetic IDX files; returns its call log."""
    calls: list[tuple[str, bool]] = []

    class FakeMNIST:
        def __init__(self, root: str, train: bool, download: bool) -> None:
            calls.append((root, train))
            write_mnist(Path(root) / "MNIST" / "raw", synthetic_mnist(), gz=True)

    module = types.ModuleType("torchvision")
    module.datasets = types.SimpleNamespace(MNIST=FakeMNIST)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", module)
    return calls


def test_download_uses_torchvision_then_our_readers(
    tmp_path: Path, no_default_dirs: None, fake_torchvision: list[tuple[str, bool]]
) -> None:
    ds = load_dataset("mnist", str(tmp_path / "root"), download=True)

    assert ds.source == str((tmp_path / "root" / "MNIST" / "raw").absolute())
    assert [train for _, train in fake_torchvision] == [True, False]
    load_dataset("mnist", str(tmp_path / "root"), download=True)
    assert len(fake_torchvision) == 2  # found, so not downloaded again


def test_nothing_is_downloaded_unless_asked(
    tmp_path: Path, no_default_dirs: None, fake_torchvision: list[tuple[str, bool]]
) -> None:
    with pytest.raises(DataError, match="MNIST not found"):
        load_dataset("mnist", str(tmp_path))
    assert fake_torchvision == []


def test_download_needs_a_destination(no_default_dirs: None, fake_torchvision: list[tuple[str, bool]]) -> None:
    with pytest.raises(DataError, match="--download needs --data-dir"):
        load_dataset("mnist", download=True)


# --------------------------------------------------------------------------- CIFAR-10


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_batches_in_torchvision_layout(tmp_path: Path, no_default_dirs: None, protocol: int) -> None:
    written = write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)

    ds = load_dataset("cifar10", str(tmp_path))

    assert ds.train_x.shape == (20, 3, 32, 32) and ds.test_x.shape == (4, 3, 32, 32) and ds.input_shape == (3, 32, 32)
    data, labels = written["data_batch_2"]
    assert ds.train_y[4:8].tolist() == labels
    # rows are R(1024) G(1024) B(1024), each row-major 32x32
    assert np.array_equal(unnormalise(ds.train_x[4, 1], 0.4822, 0.2435), data[0, 1024:2048].reshape(32, 32))
    blue = written["test_batch"][0][:, 2048:].reshape(-1, 32, 32)
    assert np.array_equal(unnormalise(ds.test_x[:, 2], 0.4465, 0.2616), blue)


class _Exploit:
    """Pickles into a call of os.system, as a tampered batch would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def test_malicious_cifar_batch_is_refused_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Exploit(marker), b"labels": [0]}, protocol=2))

    with pytest.raises(DataError, match="refused") as info:
        read_cifar10_batch(path)

    assert str(path) in str(info.value) and "system is not allowed" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "batch",
    [
        {b"labels": [1]},
        {b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]},
        {b"data": np.zeros((2, 100), np.uint8), b"labels": [1, 2]},
        {b"data": np.zeros((1, 3072), np.uint8), b"labels": [10]},
        [1, 2, 3],
    ],
    ids=["no-data", "label-count", "row-size", "label-range", "not-a-dict"],
)
def test_malformed_cifar_batch_is_a_data_error(tmp_path: Path, batch: object) -> None:
    path = tmp_path / "test_batch"
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=str(path)):
        read_cifar10_batch(path)


def test_truncated_cifar_batch_is_a_data_error(tmp_path: Path, no_default_dirs: None) -> None:
    write_cifar(tmp_path)
    path = tmp_path / "data_batch_3"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataError, match=f"{path} is not a readable CIFAR-10 batch"):
        load_dataset("cifar10", str(tmp_path))


# --------------------------------------------------------------------------- real data and the table


def _require_fashion() -> None:
    fashion_mnist()


def test_real_fashion_mnist_is_found_without_being_told(monkeypatch: pytest.MonkeyPatch) -> None:
    _require_fashion()
    monkeypatch.delenv(registry.ENV_DATA_DIR, raising=False)

    ds = load_dataset("fashion-mnist")

    assert ds.source == str(FASHION_DIR)
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.num_classes == 10 and torch.equal(torch.bincount(ds.train_y), torch.full((10,), 6000))
    assert abs(ds.train_x.mean().item()) < 0.01 and abs(ds.train_x.std().item() - 1) < 0.01


def test_dataset_table_lists_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    _require_fashion()
    monkeypatch.delenv(registry.ENV_DATA_DIR, raising=False)

    table = dataset_table().set_index("dataset")

    assert tuple(table.index) == DATASET_NAMES
    assert list(table.columns) == ["found_at", "train", "test", "shape", "classes", "how_to_get"]
    assert table.loc["digits", "found_at"] == "scikit-learn (bundled)"
    assert table.loc["fashion-mnist", "found_at"] == str(FASHION_DIR)
    assert (table.loc["fashion-mnist", "train"], table.loc["fashion-mnist", "test"]) == (60000, 10000)
    assert table.loc["cifar10", "shape"] == "3x32x32" and table.loc["digits", "shape"] == "1x8x8"
    assert table.loc["fashion-mnist", "how_to_get"] == ""


def test_dataset_table_reads_headers_only(
    tmp_path: Path, no_default_dirs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_mnist(tmp_path / "MNIST" / "raw", synthetic_mnist(n_train=12, n_test=5), gz=True)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("dataset_table must not load whole files")

    monkeypatch.setattr(registry, "read_idx", forbidden)
    monkeypatch.setattr(registry, "read_cifar10_batch", forbidden)

    table = dataset_table(str(tmp_path)).set_index("dataset")

    assert (table.loc["mnist", "train"], table.loc["mnist", "test"]) == (12, 5)
    assert table.loc["fashion-mnist", "found_at"] == ""
    assert "dataset-fashion-mnist" in table.loc["fashion-mnist", "how_to_get"]
    assert table.loc["cifar10", "train"] is pd.NA


# --------------------------------------------------------------------------- partitions


@pytest.fixture(scope="module")
def digit_labels(digits: Dataset) -> np.ndarray:
    return digits.train_y.numpy()


def _check_cover(part: Partition, n: int) -> None:
    everything = np.concatenate((*part.clients, part.holdout))
    assert np.array_equal(np.sort(everything), np.arange(n)), "clients and holdout must cover each index exactly once"
    for indices in (*part.clients, part.holdout):
        assert indices.dtype == np.int64 and np.all(np.diff(indices) > 0)


@pytest.mark.parametrize("scheme", ["iid", "classes:2", "classes:3", "classes:1", "dirichlet:0.3", "dirichlet:100"])
def test_partition_is_disjoint_covering_and_seeded(digit_labels: np.ndarray, scheme: str) -> None:
    part = partition_dataset(digit_labels, num_clients=5, scheme=scheme, seed=7)
    same = partition_dataset(digit_labels, num_clients=5, scheme=scheme, seed=7)
    other = partition_dataset(digit_labels, num_clients=5, scheme=scheme, seed=8)

    _check_cover(part, digit_labels.size)
    assert part.num_clients == 5
    assert all(np.array_equal(a, b) for a, b in zip(part.to_arrays().values(), same.to_arrays().values()))
    assert not all(np.array_equal(a, b) for a, b in zip(part.to_arrays().values(), other.to_arrays().values()))


def test_iid_parts_are_near_equal(digit_labels: np.ndarray) -> None:
    part = partition_dataset(digit_labels, num_clients=4, scheme="iid", seed=0, holdout_fraction=0.0)
    sizes = [c.size for c in part.clients]
    assert part.holdout.size == 0 and max(sizes) - min(sizes) <= 1 and sum(sizes) == digit_labels.size


def test_classes_two_of_ten_with_five_clients_is_disjoint(digit_labels: np.ndarray) -> None:
    part = partition_dataset(digit_labels, num_clients=5, scheme="classes:2", seed=3)

    held = [set(np.unique(digit_labels[c]).tolist()) for c in part.clients]

    assert all(len(classes) == 2 for classes in held)
    assert set().union(*held) == set(range(10)) and sum(len(c) for c in held) == 10


def test_classes_three_with_five_clients_overlaps_evenly(digit_labels: np.ndarray) -> None:
    part = partition_dataset(digit_labels, num_clients=5, scheme="classes:3", seed=3, holdout_fraction=0.0)

    held = [set(np.unique(digit_labels[c]).tolist()) for c in part.clients]

    assert all(len(classes) == 3 for classes in held)
    for cls in range(10):
        shares = [int(np.sum(digit_labels[c] == cls)) for k, c in enumerate(part.clients) if cls in held[k]]
        assert shares, f"class {cls} is held by no client"
        assert max(shares) - min(shares) <= 1, f"class {cls} is not split evenly: {shares}"


def test_classes_leaving_classes_unassigned_puts_them_in_holdout(digit_labels: np.ndarray) -> None:
    part = partition_dataset(digit_labels, num_clients=3, scheme="classes:1", seed=0)

    held = set(np.concatenate([digit_labels[c] for c in part.clients]).tolist())

    assert len(held) == 3
    _check_cover(part, digit_labels.size)
    assert set(np.unique(digit_labels[part.holdout]).tolist()) == set(range(10))


def _label_skew(labels: np.ndarray, part: Partition) -> float:
    """Mean total-variation distance between each client's label distribution and the global one."""
    overall = np.bincount(labels, minlength=10) / labels.size
    return float(
        np.mean([0.5 * np.abs(np.bincount(labels[c], minlength=10) / c.size - overall).sum() for c in part.clients])
    )


def test_dirichlet_alpha_controls_skew(digit_labels: np.ndarray) -> None:
    skewed = partition_dataset(digit_labels, num_clients=5, scheme="dirichlet:0.05", seed=0)
    uniform = partition_dataset(digit_labels, num_clients=5, scheme="dirichlet:1000", seed=0)

    assert _label_skew(digit_labels, skewed) > 0.5
    assert _label_skew(digit_labels, uniform) < 0.05
    assert min(c.size for c in skewed.clients) >= 10


def test_dirichlet_gives_up_with_a_clear_error() -> None:
    labels = np.repeat(np.arange(2), 15)  # 2 classes, 30 records: 3 clients of >= 10 each under alpha=0.001 is hopeless
    with pytest.raises(PartitionError, match=r"did not give each of 3 clients at least 10 records in 1000 draws"):
        partition_dataset(labels, num_clients=3, scheme="dirichlet:0.001", seed=0, holdout_fraction=0.0)


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25])
def test_holdout_is_stratified(digit_labels: np.ndarray, fraction: float) -> None:
    part = partition_dataset(digit_labels, num_clients=5, scheme="iid", seed=0, holdout_fraction=fraction)

    per_class = np.bincount(digit_labels[part.holdout], minlength=10) / np.bincount(digit_labels, minlength=10)

    assert np.all(np.abs(per_class - fraction) < 0.01)


def test_holdout_keeps_a_member_of_every_class() -> None:
    labels = np.array([0, 0, 1, 2, 2, 2])
    part = partition_dataset(labels, num_clients=1, scheme="iid", seed=0, holdout_fraction=0.9)
    assert set(labels[part.clients[0]].tolist()) == {0, 1, 2}


def test_membership_arrays_round_trip(tmp_path: Path, digit_labels: np.ndarray) -> None:
    part = partition_dataset(digit_labels, num_clients=3, scheme="dirichlet:0.5", seed=1)
    np.savez(tmp_path / "membership.npz", **part.to_arrays())

    with np.load(tmp_path / "membership.npz", allow_pickle=False) as stored:
        again = Partition.from_arrays(stored)

    assert list(part.to_arrays()) == ["client_0", "client_1", "client_2", "holdout"]
    assert again.num_clients == 3
    assert all(np.array_equal(a, b) for a, b in zip(part.to_arrays().values(), again.to_arrays().values()))
    with pytest.raises(ValueError):
        again.holdout[0] = 5  # read-only


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"client_0": np.array([1, 2])}, "lack 'holdout'"),
        ({"client_1": np.array([1]), "holdout": np.array([0])}, "client_0 .. client_"),
        ({"client_0": np.array([1]), "extra": np.array([2]), "holdout": np.array([0])}, "clients: client_0, extra"),
        ({"holdout": np.array([0])}, "found clients: none"),
        ({"client_0": np.array([2, 1]), "holdout": np.array([0])}, "client_0 must be sorted"),
        ({"client_0": np.array([1, 2]), "holdout": np.array([2])}, "disjoint"),
        ({"client_0": np.array([0.5]), "holdout": np.array([0])}, "client_0 must be a 1-D array of integer"),
        ({"client_0": np.array([[1]]), "holdout": np.array([0])}, "client_0 must be a 1-D array"),
        ({"client_0": np.array([-1, 3]), "holdout": np.array([0])}, "negative"),
        ({"client_0": np.array([], np.int64), "holdout": np.array([0])}, "client_0 holds no records"),
    ],
)
def test_from_arrays_rejects_malformed_input(arrays: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        Partition.from_arrays(arrays)


@pytest.mark.parametrize(
    ("spec", "normalised"),
    [
        ("iid", "iid"),
        (" IID ", "iid"),
        ("classes:2", "classes:2"),
        ("Classes: 03", "classes:3"),
        ("dirichlet:0.5", "dirichlet:0.5"),
        ("dirichlet:1", "dirichlet:1.0"),
        ("dirichlet:1e-2", "dirichlet:0.01"),
    ],
)
def test_validate_partition_spec_normalises(spec: str, normalised: str) -> None:
    assert validate_partition_spec(spec) == normalised


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("random", "unknown partition scheme 'random'"),
        ("iid:3", "unknown partition scheme"),
        ("classes", "unknown partition scheme"),
        ("classes:two", "malformed class count"),
        ("classes:2.5", "malformed class count"),
        ("classes:0", "at least one class per client"),
        ("dirichlet:", "malformed concentration"),
        ("dirichlet:0", "finite ALPHA > 0"),
        ("dirichlet:-1", "finite ALPHA > 0"),
        ("dirichlet:nan", "finite ALPHA > 0"),
        ("dirichlet:inf", "finite ALPHA > 0"),
        (3, "must be a string"),
    ],
)
def test_validate_partition_spec_rejects(spec: str, message: str) -> None:
    with pytest.raises(PartitionError, match=message) as info:
        validate_partition_spec(spec)
    assert "'iid', 'classes:K'" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_clients": 0}, "num_clients must be an integer >= 1"),
        ({"num_clients": 2.0}, "num_clients must be an integer >= 1"),
        ({"num_clients": True}, "num_clients must be an integer >= 1"),
        ({"num_clients": 1438}, "cannot split 1437 records among 1438 clients"),
        ({"scheme": "shards:2"}, "unknown partition scheme 'shards:2'"),
        ({"scheme": "classes:x"}, "malformed class count"),
        ({"scheme": "classes:11"}, "more classes per client than the 10 the data has"),
        ({"holdout_fraction": 1.0}, r"holdout_fraction must be in \[0, 1\)"),
        ({"holdout_fraction": -0.1}, r"holdout_fraction must be in \[0, 1\)"),
        ({"holdout_fraction": float("nan")}, r"holdout_fraction must be in \[0, 1\)"),
        ({"holdout_fraction": "a lot"}, "holdout_fraction must be a number"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"seed": 1.5}, "seed must be a non-negative integer"),
        ({"num_clients": 1400}, "ends up with no records under iid with 1400 clients"),
    ],
)
def test_partition_errors(digit_labels: np.ndarray, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"num_clients": 5, "scheme": "iid", "seed": 0, "holdout_fraction": 0.1, **kwargs}
    with pytest.raises(PartitionError, match=message) as info:
        partition_dataset(digit_labels, **args)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("labels", [np.array([]), np.array([0.0, 1.0]), np.array([[0, 1]]), np.array([0, -1])])
def test_partition_rejects_bad_labels(labels: np.ndarray) -> None:
    with pytest.raises(PartitionError, match="labels must be a non-empty 1-D array"):
        partition_dataset(labels, num_clients=1, scheme="iid", seed=0)


def test_classes_client_can_end_up_empty() -> None:
    labels = np.array([0, 1, 2])  # every client holds all three classes, but each class has a single record
    with pytest.raises(PartitionError, match="client 1 ends up with no records under classes:3"):
        partition_dataset(labels, num_clients=3, scheme="classes:3", seed=0, holdout_fraction=0.0)


def test_partition_errors_are_data_errors() -> None:
    assert issubclass(PartitionError, DataError) and issubclass(DataError, ValueError)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_the_size_of_an_idx_file_is_checked_against_its_header(tmp_path: Path, gz: bool) -> None:
    """A truncated file whose header promises a million records is not reported as a million records."""
    images = write_idx(tmp_path / "images", np.zeros((10, 28, 28), dtype=np.uint8), gz=gz)
    data = gzip.decompress(images.read_bytes()) if gz else images.read_bytes()
    data = data[:4] + struct.pack(">I", 1_000_000) + data[8:]
    images.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(DataError, match="header promises 784000000"):
        read_idx_shape(images)


def test_an_idx_file_promising_gigabytes_is_refused_before_it_is_read(tmp_path):
    """A gzip of a few megabytes can inflate to gigabytes: the header's promise is judged first (the whole file was
    decompressed into memory, then found too large)."""
    from fedaudit.data.readers import read_idx

    path = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(bytes([0, 0, 0x08, 3]) + struct.pack(">III", 100_000, 200, 200) + bytes(1 << 20))
    with pytest.raises(DataError, match="header promises 3.7 GiB of data, more than any IDX dataset"):
        read_idx(path, ndim=3)

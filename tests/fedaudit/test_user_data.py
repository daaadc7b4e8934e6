"""The user's own data (npz:, csv:, folder:): read into the same Dataset as the built-in ones, split, standardised and
fingerprinted; malformed files are one sentence naming the file, and nothing is ever unpickled."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import FAST_ARGS, assert_user_error, invoke
from PIL import Image

from fedaudit.data import DataError, load_dataset

RNG = np.random.default_rng(0)


def npz(tmp_path: Path, name: str = "data.npz", **arrays: np.ndarray) -> Path:
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def images(n: int = 200, classes: int = 3, shape: tuple[int, ...] = (1, 8, 8)) -> dict[str, np.ndarray]:
    return {"x": RNG.random((n, *shape)).astype(np.float32), "y": np.arange(n) % classes}


def test_an_npz_with_its_own_test_split_is_read_as_given(tmp_path):
    arrays = images(60, 3)
    test = images(30, 3)
    path = npz(tmp_path, x=arrays["x"], y=arrays["y"] + 5, x_test=test["x"], y_test=test["y"] + 5)
    dataset = load_dataset(f"npz:{path}")
    assert (len(dataset.train_y), len(dataset.test_y), dataset.num_classes) == (60, 30, 3)
    assert dataset.train_y.tolist() == (arrays["y"]).tolist()  # labels 5, 6, 7 become classes 0, 1, 2
    assert dataset.input_shape == (1, 8, 8)
    mean, std = dataset.train_x.mean().item(), dataset.train_x.std().item()
    assert abs(mean) < 1e-5 and abs(std - 1) < 1e-2  # standardised with the training split's statistics
    expected = (test["x"] - arrays["x"].mean()) / arrays["x"].std()
    assert np.allclose(dataset.test_x.numpy(), expected, atol=1e-5)
    assert load_dataset(f"npz:{path}").fingerprint == dataset.fingerprint
    np.savez(path, x=arrays["x"], y=arrays["y"] + 5, x_test=test["x"], y_test=(test["y"] + 1) % 3 + 5)
    assert load_dataset(f"npz:{path}").fingerprint != dataset.fingerprint


def test_without_a_test_split_a_stratified_fifth_is_held_out(tmp_path):
    path = npz(tmp_path, **images(200, 4, (12,)))  # tabular records [N, F]
    dataset = load_dataset(f"npz:{path}")
    assert (len(dataset.train_y), len(dataset.test_y), dataset.input_shape) == (160, 40, (1, 1, 12))
    assert np.bincount(dataset.test_y.numpy()).tolist() == [10, 10, 10, 10]
    per_feature = dataset.train_x.reshape(160, 12)
    assert np.allclose(per_feature.mean(0).numpy(), 0, atol=1e-5)
    assert np.allclose(per_feature.std(0, unbiased=False).numpy(), 1, atol=1e-4)


def test_the_held_out_fifth_is_scikit_learn_s_stratified_split_drawn_without_it():
    """The known answer: scikit-learn's ``train_test_split(test_size=0.2, stratify=y, random_state=seed)``, position
    for position, on label arrays of many shapes (balanced, skewed, classes of two records, ties in the remainders,
    labels that are not 0..K-1), for seeds 0-2: fedaudit's split draws the same numbers without importing it."""
    from sklearn.model_selection import train_test_split

    from fedaudit.data.user import stratified_split

    rng = np.random.default_rng(7)
    cases = [np.arange(10) % 2, np.arange(200) % 4, np.repeat([3, -1, 9], [2, 2, 96]), np.repeat([0, 1], [5, 6])]
    for _ in range(60):
        classes = int(rng.integers(2, 12))
        counts = rng.integers(2, int(rng.choice([3, 10, 80])) + 2, size=classes)
        labels = rng.choice(10_000, size=classes, replace=False) - 5_000
        cases.append(rng.permutation(np.repeat(labels, counts)))
    compared = 0
    for y in cases:
        n_test = int(np.ceil(0.2 * len(y)))
        if min(n_test, len(y) - n_test) < len(np.unique(y)):
            continue  # scikit-learn refuses these too (fedaudit with one sentence)
        for seed in range(3):
            train, test = train_test_split(np.arange(len(y)), test_size=0.2, stratify=y, random_state=seed)
            ours = stratified_split(y, n_test, seed)
            assert ours[0].tolist() == train.tolist() and ours[1].tolist() == test.tolist(), (y, seed)
            compared += 1
    assert compared >= 120  # 45 of the 64 label arrays, three seeds each


class _Payload:
    """A pickle that would leave a file behind if it were ever loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def test_a_pickled_or_ragged_array_is_refused_and_never_loaded(tmp_path):
    marker = tmp_path / "marker"
    payload = np.empty(2, dtype=object)
    payload[:] = [_Payload(marker), _Payload(marker)]
    path = npz(tmp_path, "evil.npz", x=payload, y=np.array([0, 1]))
    with pytest.raises(DataError, match=r"evil\.npz holds a pickled \(object\) array"):
        load_dataset(f"npz:{path}")
    assert not marker.exists()
    pickle.dumps(payload)  # the payload is a real pickle: the refusal is what kept it from running
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.zeros(3), np.zeros(4)]
    path = npz(tmp_path, "ragged.npz", x=ragged, y=np.array([0, 1]))
    with pytest.raises(DataError, match="ragged lists become object arrays"):
        load_dataset(f"npz:{path}")


@pytest.mark.parametrize(
    ("arrays", "mentions"),
    [
        ({"y": np.zeros(10)}, "no array 'x'"),
        ({"x": np.zeros((10, 4))}, "no array 'y'"),
        ({"x": np.zeros((10, 4)), "y": np.zeros(9)}, "one label each"),
        ({"x": np.zeros((10, 4)), "y": np.full(10, 0.5)}, "not integers"),
        ({"x": np.full((10, 4), np.nan), "y": np.arange(10) % 2}, "NaN"),
        ({"x": np.zeros((10, 2, 2, 2, 2)), "y": np.arange(10) % 2}, "expected [N, F]"),
        ({"x": np.array(["a"] * 10), "y": np.arange(10) % 2}, "real numbers"),
        ({"x": np.zeros((10, 4)), "y": np.zeros(10)}, "a single class"),
        ({"x": np.zeros((3, 4)), "y": np.arange(3)}, "too few records"),
        ({"x": np.zeros((10, 4)), "y": np.arange(10) % 5}, "too few records"),  # 2 test records for 5 classes
        ({"x": np.zeros((10, 4)), "y": np.arange(10) % 2, "x_test": np.zeros((4, 4))}, "only one of x_test"),
        (
            {"x": np.zeros((10, 4)), "y": np.arange(10) % 2, "x_test": np.zeros((4, 3)), "y_test": np.zeros(4)},
            "x_test's records have shape",
        ),
        (
            {"x": np.zeros((10, 4)), "y": np.arange(10) % 2, "x_test": np.zeros((4, 4)), "y_test": np.full(4, 7)},
            "label 7, which no training record has",
        ),
    ],
)
def test_malformed_npz_files_are_one_sentence_naming_the_file(tmp_path, arrays, mentions):
    path = npz(tmp_path, "bad.npz", **arrays)
    with pytest.raises(DataError, match=None) as caught:
        load_dataset(f"npz:{path}")
    assert str(path) in str(caught.value) and mentions in str(caught.value), caught.value


def test_a_csv_reads_its_feature_columns_and_label_column(tmp_path):
    frame = pd.DataFrame(RNG.normal(size=(100, 3)), columns=["age", "dose", "weight"])
    frame.insert(1, "outcome", np.arange(100) % 2)
    path = tmp_path / "records.csv"
    frame.to_csv(path, index=False)
    dataset = load_dataset(f"csv:{path}", label_column="outcome")
    assert (len(dataset.train_y), dataset.input_shape, dataset.num_classes) == (80, (1, 1, 3), 2)
    with pytest.raises(DataError, match="needs --label-column"):
        load_dataset(f"csv:{path}")
    with pytest.raises(DataError, match="no column 'label'"):
        load_dataset(f"csv:{path}", label_column="label")
    frame["age"] = frame["age"].astype(str) + "y"
    frame.to_csv(path, index=False)
    with pytest.raises(DataError, match="column 'age' is not numeric"):
        load_dataset(f"csv:{path}", label_column="outcome")
    frame["age"] = 1.0
    frame["outcome"] = frame["outcome"] + 0.5
    frame.to_csv(path, index=False)
    with pytest.raises(DataError, match="not integers"):
        load_dataset(f"csv:{path}", label_column="outcome")
    frame["outcome"] = np.arange(100) % 2
    frame.loc[3, "dose"] = None
    frame.to_csv(path, index=False)
    with pytest.raises(DataError, match=r"empty or NaN cells \(the first: row 4, column 'dose'\)"):
        load_dataset(f"csv:{path}", label_column="outcome")
    path.write_text(path.read_text().replace(",,", ",nan,"))  # written out: not empty, but no number either
    with pytest.raises(DataError, match=r"empty or NaN cells \(the first: row 4, column 'dose'\)"):
        load_dataset(f"csv:{path}", label_column="outcome")


def _image_folder(root: Path, classes: dict[str, int], mode: str = "RGB") -> Path:
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            pixels = (RNG.random((10, 14, 3) if mode == "RGB" else (10, 14)) * 255).astype(np.uint8)
            Image.fromarray(pixels, mode=mode).save(root / name / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


def test_a_folder_of_images_is_one_class_per_sub_folder_resized(tmp_path):
    root = _image_folder(tmp_path / "pets", {"cat": 10, "dog": 15})
    dataset = load_dataset(f"folder:{root}", image_size=12)
    assert (dataset.input_shape, dataset.num_classes, len(dataset.train_y) + len(dataset.test_y)) == (
        (3, 12, 12),
        2,
        25,
    )
    grey = _image_folder(tmp_path / "scans", {"a": 10, "b": 10}, mode="L")
    assert load_dataset(f"folder:{grey}").input_shape == (1, 32, 32)


def test_malformed_image_folders_name_what_is_wrong(tmp_path):
    root = _image_folder(tmp_path / "pets", {"cat": 10, "dog": 10})
    with pytest.raises(DataError, match="--image-size"):
        load_dataset(f"folder:{root}", image_size=0)
    (root / "bird").mkdir()
    with pytest.raises(DataError, match="bird holds no PNG or JPEG image"):
        load_dataset(f"folder:{root}")
    (root / "bird" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match="broken.png is not a readable image"):
        load_dataset(f"folder:{root}")
    with pytest.raises(DataError, match="at least two"):
        load_dataset(f"folder:{_image_folder(tmp_path / 'one', {'only': 5})}")


def test_own_data_trains_attacks_and_reports_through_the_command_line(tmp_path):
    path = npz(tmp_path, **images(300, 3))
    args = [a for a in FAST_ARGS if a not in ("--dataset", "digits")]
    run = tmp_path / "run"
    result = invoke("train", "--dataset", f"npz:{path}", *args, "--dp", "--rounds", "2", "--out", run)
    assert result.exit_code == 0, result.output
    assert invoke("attack", run, "--no-progress").exit_code == 0
    assert invoke("report", run, "--out", tmp_path / "r.md").exit_code == 0
    assert f"| dataset source | {path} |" in (tmp_path / "r.md").read_text()
    listed = invoke("datasets", f"npz:{path}")
    assert listed.exit_code == 0 and f"npz:{path}" in listed.output and "1x8x8" in listed.output
    np.savez(path, **images(300, 3))  # other records under the same name: the run's fingerprint no longer matches
    assert_user_error(invoke("attack", run, "--no-progress"), mentions="fingerprint")


def _with_unreadable_member(path: Path, name: str) -> None:
    """Append a member whose stored data fails its CRC: reading it at all is an error, so a reader that succeeds
    never read it (numpy reads any member that is not an .npy whole, as bytes: a zip bomb's way in)."""
    import zipfile

    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(name, b"\0" * 1000)
    data = bytearray(path.read_bytes())
    at = data.rfind(b"\0" * 1000)
    data[at] = 1  # the stored bytes no longer match the CRC in the directory
    path.write_bytes(bytes(data))


def test_an_npz_is_read_without_its_members_that_are_not_its_arrays(tmp_path):
    """Only x, y (and x_test, y_test) are read from a user's .npz: a member called 'notes', or one called 'x'
    without .npy (numpy would read either whole, as bytes), is never decompressed; a run's membership.npz with a
    member that is not an array is one sentence."""
    rng = np.random.default_rng(0)
    path = tmp_path / "records.npz"
    np.savez(path, x=rng.random((60, 8, 8)).astype(np.float32), y=np.arange(60) % 3)
    _with_unreadable_member(path, "notes")
    dataset = load_dataset(f"npz:{path}")
    assert dataset.num_classes == 3
    bare = tmp_path / "bare.npz"
    np.savez(bare, y=np.arange(60) % 3)
    _with_unreadable_member(bare, "x")
    with pytest.raises(DataError, match="has no array 'x'"):
        load_dataset(f"npz:{bare}")


def test_labels_that_are_no_class_number_are_refused(tmp_path):
    """Labels 1e19 and 2e19 both became int64's smallest number, one class (the run trained on 2 classes without a
    word); a site's label of two billion sized the model's output, and the server's memory, by it."""
    from fedaudit.data.sites import read_site

    rng = np.random.default_rng(0)
    x = rng.random((60, 8, 8)).astype(np.float32)
    huge = tmp_path / "huge.npz"
    np.savez(huge, x=x, y=np.array([0.0, 1e19, 2e19] * 20))
    with pytest.raises(DataError, match="holds a label beyond"):
        load_dataset(f"npz:{huge}")
    site = tmp_path / "site.npz"
    np.savez(site, x=x, y=np.array([0, 1, 2_000_000_000] * 20))
    with pytest.raises(DataError, match="has label 2000000000; a site's labels are the class numbers"):
        read_site(f"npz:{site}", 0, seed=0, holdout_fraction=0.5)

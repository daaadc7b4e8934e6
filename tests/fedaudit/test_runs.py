"""fedaudit.rundir: the typed manifest records, RunDirectory's checked readers, atomic writes and canonical files."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import read_json
from safetensors.torch import load_file

import fedaudit.rundir.files as run_files
from fedaudit.config import RunConfig
from fedaudit.data import load_dataset
from fedaudit.models import ModelSpec
from fedaudit.rundir import (
    FORMAT_VERSION,
    RUN_FORMAT,
    ClientsRecord,
    DatasetRecord,
    Manifest,
    ModelRecord,
    RateRecord,
    RunDirectory,
    RunError,
    atomic_write_bytes,
    csv_bytes,
    remove_stale_temporaries,
    save_tensors,
    tensors_metadata,
)
from fedaudit.rundir.attack_records import BOUND_TEST_KEYS

FILE_TAGS = ("format", "format_version", "updated", "files")  # written by write_manifest around Manifest.to_dict()


def one_sentence(message: str) -> None:
    """A user error is one sentence: one line, a full stop at the end and none inside."""
    assert "\n" not in message, message
    assert message.endswith("."), message
    assert ". " not in message, message


def write_manifest(directory: Path, data: dict) -> RunDirectory:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").write_text(json.dumps(data))
    return RunDirectory(directory)


# ---------------------------------------------------------------------------- typed records


def test_manifest_round_trips_a_real_runs_manifest(plain_run):
    """from_dict reads every entry of a real manifest.json and to_dict writes it back unchanged."""
    data = read_json(plain_run / "manifest.json")
    manifest = Manifest.from_dict(data, "manifest.json")
    assert manifest.to_dict() == {k: v for k, v in data.items() if k not in FILE_TAGS}
    assert manifest.updated == data["updated"]
    assert (manifest.status, manifest.rounds_done, manifest.rounds) == ("complete", 3, 3)
    assert manifest.algorithm == "fedavg" and manifest.dp is False
    assert Manifest.from_dict({**data, "dp": True}, "m").dp is True
    assert manifest.engine == "local" and manifest.device == "cpu"
    assert manifest.versions["fedaudit"] == data["versions"]["fedaudit"]
    # and back again: the same record (to_dict leaves "updated" to write_manifest)
    assert Manifest.from_dict(manifest.to_dict(), "x") == dataclasses.replace(manifest, updated=None)


def test_sub_records_round_trip_with_their_types(plain_run):
    data = read_json(plain_run / "manifest.json")
    dataset = DatasetRecord.from_dict(data["dataset"], "m")
    assert dataclasses.asdict(dataset) == data["dataset"]
    assert dataset.name == "digits" and len(dataset.fingerprint) == 64

    model = ModelRecord.from_dict(data["model"], "m")
    assert model.to_dict() == data["model"]
    assert model.input_shape == (1, 8, 8) and isinstance(model.input_shape, tuple)
    assert (model.arch, model.width, model.depth, model.num_classes) == ("mlp", 16, 1, 10)
    assert model.spec == ModelSpec("mlp", (1, 8, 8), 10, 16, 1)

    clients = ClientsRecord.from_dict(data["clients"], "m")
    assert clients.to_dict() == data["clients"]
    assert isinstance(clients.num_examples, tuple) and isinstance(clients.dp_queries_per_round, tuple)
    assert sum(clients.num_examples) + clients.holdout <= dataset.train_size
    assert isinstance(clients.client_fraction_effective, float)


def test_clients_record_takes_an_integer_fraction_as_a_float():
    record = ClientsRecord.from_dict(
        {"num_examples": [3, 4], "holdout": 1, "client_fraction_effective": 1, "dp_queries_per_round": [2, 2]}, "m"
    )
    assert record.client_fraction_effective == 1.0 and isinstance(record.client_fraction_effective, float)


def test_advanced_changes_only_progress(plain_run):
    manifest = Manifest.from_dict(read_json(plain_run / "manifest.json"), "m")
    later = manifest.advanced(rounds_done=1, status="running")
    assert (later.rounds_done, later.status) == (1, "running")
    assert dataclasses.replace(later, rounds_done=3, status="complete") == manifest
    assert manifest.advanced() == manifest


def _delete(key):
    def change(data):
        section, _, name = key.rpartition(".")
        del (data[section] if section else data)[name]

    return change


def _set(key, value):
    def change(data):
        section, _, name = key.rpartition(".")
        (data[section] if section else data)[name] = value

    return change


DAMAGE = {
    # id: (change, words the error must contain)
    "missing rounds_done": (_delete("rounds_done"), ['"rounds_done"']),
    "missing dataset": (_delete("dataset"), ['"dataset"']),
    "rounds as a string": (_set("rounds", "3"), ['"rounds"']),
    "rounds_done a bool": (_set("rounds_done", True), ['"rounds_done"']),
    "dp an int": (_set("dp", 1), ['"dp"']),
    "versions a list": (_set("versions", ["1"]), ['"versions"']),
    "unknown status": (_set("status", "paused"), ["unknown status", "'paused'"]),
    "status not a string": (_set("status", 3), ['"status"']),
    "model not a mapping": (_set("model", "mlp"), ['"model"']),
    "input_shape of length 2": (_set("model.input_shape", [8, 8]), ["(model)", '"input_shape"', "three integers"]),
    "input_shape with a bool": (_set("model.input_shape", [1, 8, True]), ["(model)", '"input_shape"']),
    "width a float": (_set("model.width", 16.0), ["(model)", '"width"']),
    "num_classes a bool": (_set("model.num_classes", False), ["(model)", '"num_classes"']),
    "missing fingerprint": (_delete("dataset.fingerprint"), ["(dataset)", '"fingerprint"']),
    "train_size a string": (_set("dataset.train_size", "1437"), ["(dataset)", '"train_size"']),
    "num_examples of floats": (_set("clients.num_examples", [1.5, 2.0]), ["(clients)", '"num_examples"']),
    "holdout a bool": (_set("clients.holdout", True), ["(clients)", '"holdout"']),
    "fraction a string": (
        _set("clients.client_fraction_effective", "1.0"),
        ["(clients)", '"client_fraction_effective"'],
    ),
    "queries not a list": (_set("clients.dp_queries_per_round", 8), ["(clients)", '"dp_queries_per_round"']),
}


@pytest.mark.parametrize("change, words", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_manifest_is_one_sentence_naming_the_file_and_entry(plain_run, tmp_path, change, words):
    data = copy.deepcopy(read_json(plain_run / "manifest.json"))
    change(data)
    with pytest.raises(RunError) as caught:
        Manifest.from_dict(data, "somewhere/manifest.json")
    message = str(caught.value)
    assert message.startswith("somewhere/manifest.json"), message
    assert all(word in message for word in words), message
    one_sentence(message)
    # read_manifest names the file it read
    with pytest.raises(RunError) as caught:
        write_manifest(tmp_path / "run", data).read_manifest()
    assert str(caught.value).startswith(str(tmp_path / "run" / "manifest.json")), caught.value
    assert all(word in str(caught.value) for word in words), caught.value


def test_updated_is_optional_and_ignored_when_not_a_string(plain_run):
    data = read_json(plain_run / "manifest.json")
    assert Manifest.from_dict({**data, "updated": 5}, "m").updated is None
    assert Manifest.from_dict({k: v for k, v in data.items() if k != "updated"}, "m").updated is None


# ---------------------------------------------------------------------------- RunDirectory readers


def test_read_manifest_of_a_real_run(plain_run):
    manifest = RunDirectory(plain_run).read_manifest()
    assert manifest == Manifest.from_dict(read_json(plain_run / "manifest.json"), "m")
    assert RunDirectory(plain_run).model_spec() == manifest.model.spec


@pytest.mark.parametrize(
    "tags, mentions",
    [
        ({"format": "other-run", "format_version": FORMAT_VERSION}, "no fedaudit format tag"),
        ({"format_version": FORMAT_VERSION}, "no fedaudit format tag"),
        ({"format": RUN_FORMAT, "format_version": FORMAT_VERSION + 1}, f"format {FORMAT_VERSION + 1} but"),
        ({"format": RUN_FORMAT, "format_version": str(FORMAT_VERSION)}, "format '" + str(FORMAT_VERSION) + "' but"),
        ({"format": RUN_FORMAT}, "run format None"),
    ],
)
def test_read_manifest_checks_the_format_tag_and_version(plain_run, tmp_path, tags, mentions):
    data = {k: v for k, v in read_json(plain_run / "manifest.json").items() if k not in ("format", "format_version")}
    run = write_manifest(tmp_path / "run", {**tags, **data})
    with pytest.raises(RunError) as caught:
        run.read_manifest()
    assert mentions in str(caught.value), caught.value
    assert str(tmp_path / "run") in str(caught.value)
    one_sentence(str(caught.value))


def test_read_manifest_of_no_directory_missing_file_or_bad_json(tmp_path):
    with pytest.raises(RunError, match="is not a directory"):
        RunDirectory(tmp_path / "absent").read_manifest()
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match="manifest.json is missing"):
        RunDirectory(tmp_path / "empty").read_manifest()
    (tmp_path / "empty" / "manifest.json").write_text("{not json")
    with pytest.raises(RunError, match="corrupt"):
        RunDirectory(tmp_path / "empty").read_manifest()
    (tmp_path / "empty" / "manifest.json").write_text("[1, 2]")
    with pytest.raises(RunError, match="no fedaudit format tag"):
        RunDirectory(tmp_path / "empty").read_manifest()


def test_read_run_config_of_a_real_run(plain_run):
    config = RunDirectory(plain_run).read_run_config()
    assert isinstance(config, RunConfig)
    assert config.to_dict() == read_json(plain_run / "config.json")
    assert (config.federated.algorithm, config.federated.rounds, config.privacy.dp) == ("fedavg", 3, False)


@pytest.mark.parametrize(
    "text",
    [
        '{"bogus": 1}',
        '["data", "model"]',
        '{"data": 5}',
        '{"model": {"colour": "red"}}',
        "{broken",
        '{"seed": "abc"}',
    ],
    ids=[
        "unknown section",
        "not a mapping",
        "section not a mapping",
        "unknown key in a section",
        "not json",
        "bad value",
    ],
)
def test_read_run_config_of_a_malformed_config_is_a_run_error(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(RunError) as caught:
        RunDirectory(tmp_path).read_run_config()
    assert str(tmp_path / "config.json") in str(caught.value), caught.value


def test_check_dataset_accepts_the_same_data_and_refuses_other_data(plain_run):
    run = RunDirectory(plain_run)
    dataset = load_dataset("digits")
    assert dataset.fingerprint == run.read_manifest().dataset.fingerprint
    run.check_dataset(dataset)  # the data the run was trained on: no error
    other = dataclasses.replace(dataset, fingerprint="0" * 64)
    with pytest.raises(RunError, match="fingerprint") as caught:
        run.check_dataset(other)
    assert "digits" in str(caught.value) and str(plain_run) in str(caught.value)


# ---------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_atomic_write_gives_the_mode_of_an_ordinary_open(tmp_path, umask):
    previous = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "sub" / "file.json", b"{}")
        (tmp_path / "plain").write_bytes(b"{}")
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "sub" / "file.json").stat().st_mode)
    assert mode == 0o666 & ~umask
    assert mode != 0o600  # not the private mode of a temporary file
    assert mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert (tmp_path / "sub" / "file.json").read_bytes() == b"{}"
    assert os.listdir(tmp_path / "sub") == ["file.json"]


@pytest.mark.parametrize("fails", ["replace", "fsync"])
def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, fails):
    target = tmp_path / "metrics.csv"
    atomic_write_bytes(target, b"old content")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(run_files.os, fails, broken)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new content that never lands")
    assert target.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["metrics.csv"]


def test_an_interrupted_atomic_write_leaves_no_temporary(tmp_path, monkeypatch):
    """KeyboardInterrupt is not an Exception, and still cleans up."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(tmp_path / "model.safetensors", b"x")
    assert os.listdir(tmp_path) == []


def _temporary(folder: Path, name: str) -> Path:
    """A temporary file named exactly as atomic_write_bytes names one (tempfile.mkstemp)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=run_files.TEMPORARY_SUFFIX, dir=folder)
    os.close(fd)
    return Path(path)


def test_remove_stale_temporaries_removes_only_what_atomic_writes_leave(tmp_path):
    stale = {
        _temporary(tmp_path, "manifest.json"),
        _temporary(tmp_path / "checkpoints", "round-0001.safetensors"),
        _temporary(tmp_path / "transmitted" / "round-0001", "client-000.safetensors"),
    }
    kept = [
        _temporary(tmp_path / "attacks" / "loss-threshold", "metrics.json"),  # an attack's, never training's
        _temporary(tmp_path / "other", "file.json"),  # the root is searched, not below it
        tmp_path / "notes.tmp",  # merely ends in .tmp
        tmp_path / "checkpoints" / "round-0001.tmp",
        tmp_path / ".manifest.json.short.tmp",  # not 8 random characters
        tmp_path / ".manifest.json.ABCDEFGH.tmp",  # mkstemp draws lower case only
        tmp_path / "manifest.json.abcdefgh.tmp",  # no leading dot
        tmp_path / "checkpoints" / "round-0001.safetensors",
        tmp_path / "metrics.csv",
    ]
    for path in kept:
        if not path.exists():
            path.write_bytes(b"keep")
    (tmp_path / "checkpoints" / ".dir.abcdefgh.tmp").mkdir()  # a directory, not a file
    removed = remove_stale_temporaries(tmp_path)
    assert set(removed) == stale
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept)
    assert (tmp_path / "checkpoints" / ".dir.abcdefgh.tmp").is_dir()
    assert remove_stale_temporaries(tmp_path) == []


def test_remove_stale_temporaries_of_a_real_run_removes_nothing(plain_run, tmp_path):
    from helpers import tree_digest

    copy_ = shutil.copytree(plain_run, tmp_path / "run")
    before = tree_digest(copy_)
    assert remove_stale_temporaries(copy_) == []
    assert tree_digest(copy_) == before


# ---------------------------------------------------------------------------- canonical files


def test_csv_bytes_round_trips_floats_exactly():
    values = [
        0.1,
        1 / 3,
        math.pi * 1e10,
        5e-324,
        2.2250738585072014e-308,
        123456789.12345679,
        1.7976931348623157e308,
        0.30000000000000004,
        float(np.float32(0.1)),
        -2.5e-17,
        math.nan,
    ]
    frame = pd.DataFrame({"round": range(1, len(values) + 1), "value": values, "name": [f"r{i}" for i in values]})
    back = pd.read_csv(io.BytesIO(csv_bytes(frame)))
    assert list(back.columns) == ["round", "value", "name"]
    np.testing.assert_array_equal(back["value"].to_numpy(), np.array(values))  # exact, NaN equal to NaN
    assert back["round"].tolist() == list(range(1, len(values) + 1))
    text = csv_bytes(frame).decode("utf-8")
    assert "0.30000000000000004" in text and "0.1," in text  # shortest repr, never a fixed number of digits


def test_save_tensors_is_byte_identical_for_equal_inputs_in_any_order(tmp_path):
    weights = {"layer.weight": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "bias": torch.arange(5.0)}
    metadata = {f"key{i:02d}": str(i * i) for i in range(40)}
    save_tensors(tmp_path / "a.safetensors", weights, metadata)
    save_tensors(
        tmp_path / "b.safetensors",
        dict(reversed(list(weights.items()))),
        dict(reversed(list(metadata.items()))),
    )
    save_tensors(tmp_path / "c.safetensors", weights, dict(sorted(metadata.items(), key=lambda kv: kv[1])))
    a = (tmp_path / "a.safetensors").read_bytes()
    assert a == (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "c.safetensors").read_bytes()
    assert int.from_bytes(a[:8], "little") % 8 == 0  # the header stays 8-byte aligned
    assert tensors_metadata(tmp_path / "a.safetensors") == metadata
    loaded = load_file(str(tmp_path / "a.safetensors"))
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_save_tensors_stores_non_contiguous_tensors_and_no_metadata(tmp_path):
    transposed = torch.arange(12.0).view(3, 4).t()
    save_tensors(tmp_path / "t.safetensors", {"t": transposed})
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["t"], transposed)
    assert tensors_metadata(tmp_path / "t.safetensors") == {}


# ---------------------------------------------------------------------------- load_model


def test_load_model_rebuilds_the_final_model_from_safetensors(plain_run):
    model = RunDirectory(plain_run).load_model()
    assert not model.training
    stored = load_file(str(plain_run / "model.safetensors"))
    state = model.state_dict()
    assert state.keys() == stored.keys()
    assert all(torch.equal(state[k], stored[k]) for k in stored)
    checkpoint = RunDirectory(plain_run).load_model(round_number=1)
    assert any(not torch.equal(checkpoint.state_dict()[k], stored[k]) for k in stored)


@pytest.mark.parametrize("damage", ["missing tensor", "extra tensor", "wrong shape"])
def test_load_model_refuses_weights_that_do_not_fit_the_manifest(plain_run, tmp_path, damage):
    run = RunDirectory(shutil.copytree(plain_run, tmp_path / "run"))
    weights = load_file(str(run.checkpoints.path(1)))
    name = sorted(weights)[0]
    if damage == "missing tensor":
        del weights[name]
    elif damage == "extra tensor":
        weights["extra.weight"] = torch.zeros(2)
    else:
        weights[name] = torch.zeros(*weights[name].shape[:-1], weights[name].shape[-1] + 1)
    save_tensors(run.checkpoints.path(1), weights, {"round": "1"})
    with pytest.raises(RunError, match="do not fit the mlp model") as caught:
        run.load_model(round_number=1)
    assert str(run.checkpoints.path(1)) in str(caught.value)


def test_load_model_refuses_a_final_model_of_another_round(plain_run, tmp_path):
    run = RunDirectory(shutil.copytree(plain_run, tmp_path / "run"))
    save_tensors(run.model_path, load_file(str(run.checkpoints.path(2))), {"round": "2"})
    with pytest.raises(RunError, match="model.safetensors is from round 2 but manifest.json records 3"):
        run.load_model()


def test_load_model_of_a_corrupt_file(plain_run, tmp_path):
    run = RunDirectory(shutil.copytree(plain_run, tmp_path / "run"))
    run.checkpoints.path(1).write_bytes(b"not safetensors at all")
    with pytest.raises(RunError, match="corrupt or not a safetensors file"):
        run.load_model(round_number=1)
    with pytest.raises(RunError, match="does not exist"):
        run.load_model(round_number=99)


def test_attack_record_reads_the_current_format_and_format_1(tmp_path):
    run = RunDirectory(tmp_path)
    current = {
        "format_version": 2,
        "signal": "grad-norm",
        "method": "threshold",
        "round": 3,
        "seed": 0,
        "nonmembers": "both",
        "max_records": 2000,
        "bootstrap_resamples": 1000,
        "per_layer": False,
        "auc": 0.6,
        "auc_ci95": [0.55, 0.65],
        "tpr_at_fpr": {"0.01": {"tpr": 0.05, "ci95": [0.01, 0.1], "estimable": True, "nonmembers_needed": 100}},
        "advantage_held_out": {"advantage": 0.1, "ci95": [0.02, 0.18]},
        "epsilon_lower_bound": 0.3,
        "epsilon_lower_bound_test": {key: 1 for key in BOUND_TEST_KEYS} | {"threshold": 0.5, "inequality": "tpr"},
    }
    (tmp_path / "attacks" / "grad-norm-threshold-round-3").mkdir(parents=True)
    (tmp_path / "attacks" / "grad-norm-threshold-round-3" / "metrics.json").write_text(json.dumps(current))
    (tmp_path / "attacks" / "loss-classifier").mkdir()
    (tmp_path / "attacks" / "loss-classifier" / "metrics.json").write_text(
        json.dumps({"auc": 0.5, "tpr_at_fpr": {"0.01": 0.02}, "epsilon_lower_bound": 1.0})
    )
    assert run.attacks.names() == ["grad-norm-threshold-round-3", "loss-classifier"]
    record = run.attacks.read("grad-norm-threshold-round-3")
    assert (record.signal, record.method, record.round, record.format_version) == ("grad-norm", "threshold", 3, 2)
    assert record.settings == {
        "seed": 0,
        "nonmembers": "both",
        "max_records": 2000,
        "bootstrap_resamples": 1000,
        "per_layer": False,
    }
    assert record.tpr_at_fpr["0.01"].ci95 == (0.01, 0.1) and record.tpr_at_fpr["0.001"] is None
    assert record.advantage_held_out_ci95 == (0.02, 0.18) and record.epsilon_lower_bound_test["inequality"] == "tpr"
    old = run.attacks.read("loss-classifier")
    assert (old.signal, old.method, old.round) == ("loss", "classifier", None)  # from the directory's name
    assert old.tpr_at_fpr["0.01"] == RateRecord(tpr=0.02, detailed=False)
    assert old.epsilon_lower_bound == 1.0 and old.epsilon_lower_bound_test is None  # format 1: no test recorded


def test_a_malformed_attack_record_is_a_run_error(tmp_path):
    folder = tmp_path / "attacks" / "loss-threshold"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"tpr_at_fpr": {"0.01": {"tpr": 0.1, "nonmembers_needed": "x"}}}))
    with pytest.raises(RunError, match="nonmembers_needed"):
        RunDirectory(tmp_path).attacks.read("loss-threshold")
    (folder / "metrics.json").write_text("{not json")
    with pytest.raises(RunError, match="not valid JSON"):
        RunDirectory(tmp_path).attacks.read("loss-threshold")

"""The ``fedaudit`` command line: train's run directory, resume, user errors, epsilon and datasets."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import opacus
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

import fedaudit
from conftest import FAST_ARGS, tree_digest
from fedaudit.config import RunConfig
from fedaudit.data import load_dataset
from fedaudit.privacy.accounting import calibrate_noise_multiplier, epsilon_per_round
from fedaudit.runs import METRIC_COLUMNS
from fedaudit.training import select_clients

BATCH = 32  # FAST_ARGS' --batch-size


# ---------------------------------------------------------------------------- helpers


def read_json(path: Path):
    return json.loads(path.read_text())


def assert_user_error(result, *, mentions: str | None = None) -> str:
    """Exit code 2 and exactly one line on stderr, starting with 'Error:', without a traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    if mentions is not None:
        assert mentions.lower() in lines[0].lower(), lines[0]
    return lines[0]


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def client_plan(run: Path) -> dict[int, tuple[float, int]]:
    """(q, T) of each client, from the manifest: q = B / N_k, T = E * floor(N_k / B) with E = 1."""
    sizes = read_json(run / "manifest.json")["clients"]["num_examples"]
    return {k: (BATCH / n, max(1, n // BATCH)) for k, n in enumerate(sizes)}


def epsilon_cli(cli, *args) -> float:
    result = cli("epsilon", *args)
    assert result.exit_code == 0, result.output
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("epsilon="), last
    return float(last.split("=", 1)[1])


def without_wall(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=["wall_seconds"])


def interrupt_in_round(monkeypatch, round_number: int) -> None:
    """Make fedaudit.training.evaluate raise KeyboardInterrupt in round ``round_number`` (1-based)."""
    import fedaudit.training as training

    real = training.evaluate
    calls = {"n": 0}

    def evaluate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == round_number:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "evaluate", evaluate)


# ---------------------------------------------------------------------------- the run directory


@pytest.mark.parametrize("which", ["plain_run", "dp_run"])
def test_train_writes_the_run_directory(request, which):
    run: Path = request.getfixturevalue(which)
    names = {p.name for p in run.iterdir()}
    expected = {"config.json", "manifest.json", "membership.npz", "metrics.csv", "model.safetensors", "checkpoints"}
    assert expected <= names
    assert ("privacy.json" in names) == (which == "dp_run")  # the ledger exists for DP runs only
    assert not [n for n in names if n.endswith(".tmp")]
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == [f"round-{m:04d}.{ext}" for m in (1, 2, 3) for ext in ("json", "safetensors")]


@pytest.mark.parametrize("which", ["plain_run", "dp_run"])
def test_config_json_holds_the_resolved_configuration(request, which):
    run: Path = request.getfixturevalue(which)
    stored = read_json(run / "config.json")
    config = RunConfig.from_dict(stored)
    assert config.resolved().to_dict() == stored  # already resolved: nothing left to fill in
    assert {"seed", "device", "data", "model", "federated", "privacy"} <= set(stored)
    assert stored["federated"]["client_lr"] == 0.5  # the digits default
    assert stored["federated"]["lr_schedule"] in ("constant", "cosine")
    assert stored["data"] == {"dataset": "digits", "data_dir": None, "download": False, "partition": "classes:2",
                              "num_clients": 5, "holdout_fraction": 0.1}
    assert stored["federated"]["rounds"] == 3
    assert stored["model"] == {"arch": "mlp", "width": 16, "depth": 1}
    assert stored["seed"] == 0
    if which == "dp_run":
        assert stored["privacy"]["dp"] is True
        assert stored["privacy"]["noise_multiplier"] == 1.0
        assert stored["privacy"]["max_grad_norm"] == 1.0
    else:
        assert stored["privacy"]["dp"] is False


def test_manifest_records_status_versions_and_data(plain_run):
    manifest = read_json(plain_run / "manifest.json")
    assert manifest["status"] == "complete"
    assert manifest["rounds_done"] == manifest["rounds"] == 3
    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["versions"]["opacus"] == opacus.__version__
    assert manifest["versions"]["fedaudit"] == fedaudit.__version__
    digits = load_dataset("digits")
    assert manifest["dataset"]["name"] == "digits"
    assert manifest["dataset"]["fingerprint"] == digits.fingerprint
    assert manifest["dataset"]["train_size"] == len(digits.train_y)


def test_membership_is_disjoint_and_inside_the_train_split(plain_run):
    manifest = read_json(plain_run / "manifest.json")
    with np.load(plain_run / "membership.npz", allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    assert set(arrays) == {"client_0", "client_1", "client_2", "client_3", "client_4", "holdout"}
    train_size = manifest["dataset"]["train_size"]
    everything = np.concatenate(list(arrays.values()))
    assert np.unique(everything).size == everything.size  # disjoint
    assert everything.min() >= 0 and everything.max() < train_size
    assert everything.size == train_size  # every record is a member of one client or held out
    assert [arrays[f"client_{k}"].size for k in range(5)] == manifest["clients"]["num_examples"]
    assert arrays["holdout"].size == manifest["clients"]["holdout"] > 0


@pytest.mark.parametrize("which", ["plain_run", "dp_run"])
def test_metrics_csv_has_one_row_per_round(request, which):
    run: Path = request.getfixturevalue(which)
    metrics = pd.read_csv(run / "metrics.csv")
    assert tuple(metrics.columns[: len(METRIC_COLUMNS)]) == METRIC_COLUMNS
    assert metrics["round"].tolist() == [1, 2, 3]
    assert metrics["test_accuracy"].between(0, 1).all()
    assert (metrics["test_loss"] > 0).all() and (metrics["wall_seconds"] >= 0).all()
    # Every client sends a float32 delta of every parameter.
    num_parameters = read_json(run / "manifest.json")["model"]["num_parameters"]
    assert (metrics["bytes_up"] == 5 * 4 * num_parameters).all()
    if which == "plain_run":
        assert np.isinf(metrics["epsilon"]).all()  # no DP: no finite guarantee is claimed
    else:
        assert np.isfinite(metrics["epsilon"]).all() and metrics["epsilon"].is_monotonic_increasing


@pytest.mark.parametrize("which", ["plain_run", "dp_run"])
def test_model_equals_the_last_checkpoint(request, which):
    run: Path = request.getfixturevalue(which)
    assert_same_tensors(run / "model.safetensors", run / "checkpoints" / "round-0003.safetensors")
    first = load_file(str(run / "checkpoints" / "round-0001.safetensors"))
    last = load_file(str(run / "model.safetensors"))
    assert any(not torch.equal(first[k], last[k]) for k in first)  # training moved the weights
    state = read_json(run / "checkpoints" / "round-0003.json")
    assert state["round"] == 3 and state["seed"] == 0
    assert isinstance(state["torch_cpu_rng_state"], str) and state["torch_cpu_rng_state"]


def test_privacy_json_agrees_with_metrics_and_the_epsilon_command(dp_run, cli):
    ledger = read_json(dp_run / "privacy.json")
    assert {"accountant", "delta", "noise_multiplier", "max_grad_norm", "entries", "epsilon_per_round"} <= set(ledger)
    assert (ledger["accountant"], ledger["delta"], ledger["noise_multiplier"], ledger["max_grad_norm"]) == (
        "rdp", 1e-5, 1.0, 1.0)
    metrics = pd.read_csv(dp_run / "metrics.csv")
    assert metrics["epsilon"].tolist() == pytest.approx(ledger["epsilon_per_round"], rel=1e-12)

    # The ledger reports the worst client; its entries are all M rounds of its T queries at q = B / N_k.
    plan = client_plan(dp_run)
    worst = max(plan, key=lambda k: epsilon_per_round(noise_multiplier=1.0, sample_rate=plan[k][0],
                                                      queries_per_round=plan[k][1], rounds=3)[-1])
    q, t = plan[worst]
    assert ledger["entries"] == [{"noise_multiplier": 1.0, "sample_rate": pytest.approx(q, rel=1e-12), "steps": 3 * t}]
    assert sum(e["steps"] for e in ledger["entries"]) == 3 * t

    eps = epsilon_cli(cli, "--noise-multiplier", "1.0", "--sample-rate", repr(q), "--steps", t, "--rounds", 3)
    assert eps == pytest.approx(ledger["epsilon_per_round"][-1], rel=1e-5)


def test_a_run_never_reports_less_epsilon_than_any_client_spent(dp_run):
    ledger = read_json(dp_run / "privacy.json")
    reported = ledger["epsilon_per_round"]
    spent = np.array([
        epsilon_per_round(noise_multiplier=1.0, sample_rate=q, queries_per_round=t, rounds=3)
        for q, t in client_plan(dp_run).values()
    ])
    assert np.all(np.asarray(reported) >= spent.max(axis=0) * (1 - 1e-12))
    assert reported == pytest.approx(spent.max(axis=0).tolist(), rel=1e-9)
    summary = pd.read_csv(dp_run / "metrics.csv")["epsilon"].iloc[-1]
    assert summary >= spent.max() * (1 - 1e-12)


# ---------------------------------------------------------------------------- resume


@pytest.mark.parametrize("dp", [False, True], ids=["plain", "dp"])
def test_resume_after_interrupt_equals_an_uninterrupted_run(tmp_path, monkeypatch, trained, cli, dp):
    args = ["--rounds", "3", *(["--dp"] if dp else [])]
    reference = trained(*args)
    out = tmp_path / "run"

    interrupt_in_round(monkeypatch, 2)
    result = cli("train", *FAST_ARGS, *args, "--out", out)
    assert result.exit_code == 1  # click's "Aborted!" for Ctrl-C
    manifest = read_json(out / "manifest.json")
    assert (manifest["status"], manifest["rounds_done"]) == ("interrupted", 1)
    assert len(pd.read_csv(out / "metrics.csv")) == 1
    if dp:
        assert read_json(out / "privacy.json")["rounds"] == 1

    monkeypatch.undo()
    result = cli("train", "--resume", out, "--no-progress")
    assert result.exit_code == 0, result.output
    manifest = read_json(out / "manifest.json")
    assert (manifest["status"], manifest["rounds_done"]) == ("complete", 3)
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert_same_tensors(out / "model.safetensors", reference / "model.safetensors")
    pd.testing.assert_frame_equal(without_wall(pd.read_csv(out / "metrics.csv")),
                                  without_wall(pd.read_csv(reference / "metrics.csv")))
    if dp:
        assert read_json(out / "privacy.json") == read_json(reference / "privacy.json")
    else:
        assert not (out / "privacy.json").exists()


def test_resume_after_interrupt_between_the_round_files(tmp_path, monkeypatch, dp_run, cli):
    """Ctrl-C after privacy.json but before manifest.json (the commit point) was written for round 2."""
    from fedaudit.runs import RunDirectory

    real = RunDirectory.write_privacy

    def write_privacy(self, ledger):
        real(self, ledger)
        if ledger["rounds"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(RunDirectory, "write_privacy", write_privacy)
    out = tmp_path / "run"
    assert cli("train", *FAST_ARGS, "--dp", "--rounds", "3", "--out", out).exit_code == 1
    manifest = read_json(out / "manifest.json")
    assert (manifest["status"], manifest["rounds_done"]) == ("interrupted", 1)

    monkeypatch.undo()
    result = cli("train", "--resume", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").read_bytes() == (dp_run / "model.safetensors").read_bytes()
    assert read_json(out / "privacy.json") == read_json(dp_run / "privacy.json")


def test_resume_interrupted_in_the_first_round(tmp_path, monkeypatch, plain_run, cli):
    interrupt_in_round(monkeypatch, 1)
    out = tmp_path / "run"
    assert cli("train", *FAST_ARGS, "--rounds", "3", "--out", out).exit_code == 1
    assert read_json(out / "manifest.json")["rounds_done"] == 0
    monkeypatch.undo()
    assert cli("train", "--resume", out, "--no-progress").exit_code == 0
    assert (out / "model.safetensors").read_bytes() == (plain_run / "model.safetensors").read_bytes()


def test_resume_with_more_rounds_extends_a_complete_run(tmp_path, trained, cli):
    # A constant learning rate: with the cosine schedule the horizon M changes the step sizes.
    dp_run = trained("--dp", "--rounds", "3", "--lr-schedule", "constant")
    out = tmp_path / "run"
    shutil.copytree(trained("--dp", "--rounds", "2", "--lr-schedule", "constant"), out)
    before = read_json(out / "privacy.json")
    assert len(before["epsilon_per_round"]) == 2

    result = cli("train", "--resume", out, "--rounds", "3", "--no-progress")
    assert result.exit_code == 0, result.output
    after = read_json(out / "privacy.json")
    assert after["epsilon_per_round"][:2] == before["epsilon_per_round"]
    assert len(after["epsilon_per_round"]) == 3 and after["epsilon_per_round"][2] > before["epsilon_per_round"][1]
    assert after == read_json(dp_run / "privacy.json")  # the same ledger as three rounds from the start
    assert (out / "model.safetensors").read_bytes() == (dp_run / "model.safetensors").read_bytes()
    manifest = read_json(out / "manifest.json")
    assert (manifest["status"], manifest["rounds_done"], manifest["rounds"]) == ("complete", 3, 3)
    assert read_json(out / "config.json")["federated"]["rounds"] == 3
    assert pd.read_csv(out / "metrics.csv")["round"].tolist() == [1, 2, 3]


def test_resume_of_a_complete_run_changes_nothing(tmp_path, plain_run, cli):
    out = tmp_path / "run"
    shutil.copytree(plain_run, out)
    before = tree_digest(out)
    result = cli("train", "--resume", out, "--no-progress")
    assert result.exit_code == 0, result.output
    after = tree_digest(out)
    del before["manifest.json"], after["manifest.json"]  # its "updated" time stamp moves
    assert after == before
    assert read_json(out / "manifest.json")["status"] == "complete"


@pytest.mark.parametrize(
    "extra",
    [["--dp"], ["--lr", "0.5"], ["--seed", "1"], ["--out", "OTHER"], ["--config", "CONFIG"], ["--overwrite"],
     ["--rounds", "2"], ["--rounds", "0"]],
    ids=["dp", "lr", "seed", "out", "config", "overwrite", "fewer-rounds", "zero-rounds"],
)
def test_resume_rejects_other_options(tmp_path, plain_run, cli, extra):
    out = tmp_path / "run"
    shutil.copytree(plain_run, out)
    config = tmp_path / "config.json"
    shutil.copy(out / "config.json", config)
    extra = [str(tmp_path / "other") if a == "OTHER" else str(config) if a == "CONFIG" else a for a in extra]
    before = tree_digest(out)
    assert_user_error(cli("train", "--resume", out, "--no-progress", *extra))
    assert tree_digest(out) == before
    assert not (tmp_path / "other").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_resume_honours_device(tmp_path, plain_run, cli):
    out = tmp_path / "run"
    shutil.copytree(plain_run, out)
    before = tree_digest(out)
    assert_user_error(cli("train", "--resume", out, "--rounds", "4", "--device", "cuda", "--no-progress"),
                      mentions="cuda")
    assert tree_digest(out) == before
    assert cli("train", "--resume", out, "--rounds", "4", "--device", "cpu", "--no-progress").exit_code == 0
    manifest = read_json(out / "manifest.json")
    assert (manifest["rounds_done"], manifest["device"]) == (4, "cpu")


@pytest.mark.parametrize("kind", ["missing", "empty", "not-a-run", "file"])
def test_resume_on_a_non_run_directory(tmp_path, cli, kind):
    target = tmp_path / "target"
    if kind == "empty":
        target.mkdir()
    elif kind == "not-a-run":
        target.mkdir()
        (target / "notes.txt").write_text("hello")
        (target / "manifest.json").write_text('{"something": "else"}')
    elif kind == "file":
        target.write_text("hello")
    before = tree_digest(tmp_path)
    assert_user_error(cli("train", "--resume", target, "--no-progress"))
    assert tree_digest(tmp_path) == before
    assert target.exists() == (kind != "missing")


# ---------------------------------------------------------------------------- user errors


def _write(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


BAD_TRAIN = {
    "zero-rounds": (["--rounds", "0"], "--rounds"),
    "negative-rounds": (["--rounds", "-2"], "--rounds"),
    "zero-sigma": (["--dp", "--noise-multiplier", "0"], "--noise-multiplier"),
    "negative-sigma": (["--dp", "--noise-multiplier", "-1"], "--noise-multiplier"),
    "nan-sigma": (["--dp", "--noise-multiplier", "nan"], "--noise-multiplier"),
    "zero-clip": (["--dp", "--max-grad-norm", "0"], "--max-grad-norm"),
    "negative-clip": (["--dp", "--max-grad-norm", "-0.5"], "--max-grad-norm"),
    "clip-without-dp": (["--max-grad-norm", "1"], "--dp"),
    "sigma-without-dp": (["--noise-multiplier", "1"], "--dp"),
    "target-without-dp": (["--target-epsilon", "3"], "--dp"),
    "sigma-and-target": (["--dp", "--noise-multiplier", "1", "--target-epsilon", "3"], "--target-epsilon"),
    "unreachable-target": (["--dp", "--target-epsilon", "0.01"], "unreachable"),
    "unknown-dataset": (["--dataset", "imagenet"], "imagenet"),
    "missing-data": (["--dataset", "mnist", "--data-dir", "NOWHERE"], "mnist"),
    "unknown-partition": (["--partition", "pathological"], "pathological"),
    "malformed-classes": (["--partition", "classes:two"], "classes:two"),
    "malformed-dirichlet": (["--partition", "dirichlet:-1"], "dirichlet"),
    "too-many-classes": (["--partition", "classes:11"], "classes"),
    "more-clients-than-records": (["--num-clients", "5000"], "clients"),
    "dp-batch-too-large": (["--dp", "--batch-size", "1000"], "--batch-size"),
    "client-fraction": (["--client-fraction", "0"], "--client-fraction"),
    "delta": (["--dp", "--delta", "1"], "--delta"),
    "width": (["--width", "0"], "--width"),
    "too-deep": (["--model", "convnet", "--depth", "4"], "depth"),
    "lr": (["--lr", "nan"], "--lr"),
    "seed": (["--seed", "-1"], "--seed"),
    "missing-config": (["--config", "NOWHERE/config.yaml"], "config"),
    "malformed-yaml": (["--config", "FILE:bad.yaml:federated: [rounds: 3"], "yaml"),
    "malformed-json": (["--config", "FILE:bad.json:{\"federated\": "], "json"),
    "binary-config": (["--config", "FILE:bin.yaml:\udcff\udcfe\x00\x00"], "config"),
    "unknown-section": (["--config", "FILE:c.yaml:optimiser:\n  lr: 0.1\n"], "optimiser"),
    "unknown-key": (["--config", "FILE:c.yaml:federated:\n  learning_rate: 0.1\n"], "learning_rate"),
    "not-a-mapping": (["--config", "FILE:c.yaml:- 1\n- 2\n"], "mapping"),
    "section-not-a-mapping": (["--config", "FILE:c.yaml:data: digits\n"], "data"),
    "bad-value-in-config": (["--config", "FILE:c.json:{\"federated\": {\"rounds\": \"ten\"}}"], "--rounds"),
    "out-missing": (["--out", "NONE"], "--out"),
}


@pytest.mark.parametrize("args, mentions", list(BAD_TRAIN.values()), ids=list(BAD_TRAIN))
def test_train_user_errors_are_one_sentence_exit_2_and_write_nothing(tmp_path, cli, args, mentions):
    files = tmp_path / "files"
    files.mkdir()
    resolved: list[str] = []
    for arg in args:
        if arg.startswith("FILE:"):
            _, name, content = arg.split(":", 2)
            resolved.append(_write(files, name, content.encode("utf-8", "surrogateescape")))
        else:
            resolved.append(arg.replace("NOWHERE", str(tmp_path / "nowhere")))
    out = ["--out", str(tmp_path / "run")]
    if "NONE" in resolved:
        resolved, out = [], []
    assert_user_error(cli("train", *FAST_ARGS, "--rounds", "1", *resolved, *out), mentions=mentions)
    assert not (tmp_path / "run").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files"]


def test_out_inside_a_file_is_a_user_error(tmp_path, cli):
    (tmp_path / "afile").write_text("x")
    assert_user_error(cli("train", *FAST_ARGS, "--rounds", "1", "--out", tmp_path / "afile" / "run"))
    assert (tmp_path / "afile").read_text() == "x"


def test_existing_out_is_left_byte_identical(tmp_path, plain_run, cli):
    out = tmp_path / "run"
    shutil.copytree(plain_run, out)
    before = tree_digest(out)
    assert_user_error(cli("train", *FAST_ARGS, "--rounds", "1", "--out", out), mentions="--overwrite")
    assert tree_digest(out) == before
    # --overwrite with an invalid option must not touch the old run either.
    assert_user_error(cli("train", *FAST_ARGS, "--rounds", "0", "--out", out, "--overwrite"))
    assert tree_digest(out) == before


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path, cli):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    assert_user_error(cli("train", *FAST_ARGS, "--rounds", "1", "--out", out, "--overwrite"))
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]


def test_overwrite_replaces_a_run(tmp_path, plain_run, cli):
    out = tmp_path / "run"
    shutil.copytree(plain_run, out)
    result = cli("train", *FAST_ARGS, "--width", "8", "--rounds", "1", "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert read_json(out / "manifest.json")["rounds_done"] == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["round-0001.json", "round-0001.safetensors"]


# ---------------------------------------------------------------------------- --config


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_config_file_with_command_line_overrides(tmp_path, cli, suffix):
    content = {"seed": 3, "model": {"arch": "mlp", "width": 16, "depth": 1},
               "federated": {"rounds": 4, "batch_size": 64, "local_epochs": 1, "lr_schedule": "cosine"},
               "privacy": {"dp": True, "noise_multiplier": 2.0}}
    path = tmp_path / f"config.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps(content))
    else:
        import yaml

        path.write_text(yaml.safe_dump(content))
    out = tmp_path / "run"
    result = cli("train", "--config", path, "--rounds", "1", "--noise-multiplier", "1.5", "--width", "8",
                 "--no-progress", "--out", out)
    assert result.exit_code == 0, result.output
    stored = read_json(out / "config.json")
    assert stored["federated"]["rounds"] == 1  # command line wins
    assert stored["privacy"]["noise_multiplier"] == 1.5
    assert stored["model"] == {"arch": "mlp", "width": 8, "depth": 1}
    assert stored["seed"] == 3 and stored["federated"]["batch_size"] == 64  # the file wins over defaults
    assert stored["federated"]["lr_schedule"] == "cosine"
    assert stored["privacy"]["max_grad_norm"] == 1.0  # default written out (DP-SGD's on digits)
    assert read_json(out / "privacy.json")["noise_multiplier"] == 1.5


@pytest.mark.parametrize("which", ["plain_run", "dp_run"])
def test_written_config_reproduces_the_run(request, tmp_path, cli, which):
    run: Path = request.getfixturevalue(which)
    out = tmp_path / "again"
    result = cli("train", "--config", run / "config.json", "--no-progress", "--out", out)
    assert result.exit_code == 0, result.output
    assert read_json(out / "config.json") == read_json(run / "config.json")
    assert (out / "model.safetensors").read_bytes() == (run / "model.safetensors").read_bytes()
    assert_same_tensors(out / "model.safetensors", run / "model.safetensors")


def test_yaml_config_accepts_scientific_notation(tmp_path, cli):
    path = _write(tmp_path, "c.yaml", "privacy:\n  dp: true\n  delta: 1e-6\nfederated:\n  client_lr: 5e-2\n")
    out = tmp_path / "run"
    result = cli("train", "--config", path, *FAST_ARGS, "--rounds", "1", "--out", out)
    assert result.exit_code == 0, result.output
    stored = read_json(out / "config.json")
    assert stored["privacy"]["delta"] == 1e-6 and stored["federated"]["client_lr"] == 0.05


# ---------------------------------------------------------------------------- --target-epsilon


def test_target_epsilon_calibrates_sigma(tmp_path, trained, cli):
    target = 3.0
    # Four equal clients (323 records each): one calibration serves them all, which keeps the test quick.
    equal = ("--partition", "iid", "--num-clients", "4")
    run = trained("--dp", "--rounds", "2", *equal, "--target-epsilon", str(target))
    eps = read_json(run / "privacy.json")["epsilon_per_round"]
    assert eps[-1] <= target
    assert eps[-1] >= 0.98 * target  # close to the budget, not needlessly noisy
    stored = read_json(run / "config.json")["privacy"]
    assert stored["target_epsilon"] == target and stored["calibrated"] is True
    sigma = stored["noise_multiplier"]
    (q, t), = set(client_plan(run).values())
    expected = calibrate_noise_multiplier(target_epsilon=target, sample_rate=q, queries_per_round=t, rounds=2)
    assert sigma == pytest.approx(expected, rel=1e-12)
    assert read_json(run / "privacy.json")["noise_multiplier"] == sigma

    # config.json reproduces the run ...
    same = tmp_path / "same"
    assert cli("train", "--config", run / "config.json", "--no-progress", "--out", same).exit_code == 0
    assert (same / "model.safetensors").read_bytes() == (run / "model.safetensors").read_bytes()
    # ... and a changed budget or horizon on top of it is calibrated afresh, never exceeded.
    for extra, budget in ((["--target-epsilon", "2"], 2.0), (["--rounds", "3"], target)):
        out = tmp_path / f"changed{len(extra)}{extra[0]}"
        result = cli("train", "--config", run / "config.json", *extra, "--no-progress", "--out", out)
        assert result.exit_code == 0, result.output
        final = read_json(out / "privacy.json")["epsilon_per_round"][-1]
        assert 0.98 * budget <= final <= budget, (extra, final)


# ---------------------------------------------------------------------------- client selection


def test_partial_participation_selects_ceil_pk_clients_and_accounts_with_p_q(tmp_path, trained, cli):
    args = ("--dp", "--rounds", "2", "--client-fraction", "0.3")  # ceil(0.3 * 5) = 2 clients, p_eff = 0.4
    run = trained(*args)
    manifest = read_json(run / "manifest.json")
    assert manifest["clients"]["client_fraction_effective"] == pytest.approx(0.4)
    metrics = pd.read_csv(run / "metrics.csv")
    assert metrics["clients"].tolist() == [2, 2]
    num_parameters = manifest["model"]["num_parameters"]
    assert (metrics["bytes_up"] == 2 * 4 * num_parameters).all()

    ledger = read_json(run / "privacy.json")
    plan = client_plan(run)
    for k, (q, t) in plan.items():  # every client is charged every round, first query at p_eff * q
        entries = ledger["per_client"][str(k)]["entries"]
        assert entries == [
            {"noise_multiplier": 1.0, "sample_rate": pytest.approx(0.4 * q, rel=1e-12), "steps": 2},
            {"noise_multiplier": 1.0, "sample_rate": pytest.approx(q, rel=1e-12), "steps": 2 * (t - 1)},
        ]
    worst = ledger["worst_client"]
    q, t = plan[worst]
    eps = epsilon_cli(cli, "--noise-multiplier", "1", "--sample-rate", repr(q), "--steps", t, "--rounds", 2,
                      "--client-fraction", "0.4")
    assert eps == pytest.approx(ledger["epsilon_per_round"][-1], rel=1e-5)
    full = epsilon_per_round(noise_multiplier=1.0, sample_rate=q, queries_per_round=t, rounds=2)[-1]
    assert ledger["epsilon_per_round"][-1] < full  # amplification by client sampling is used

    # The same seed gives the same selection and the same model; another seed another model.
    again = tmp_path / "again"
    assert cli("train", *FAST_ARGS, *args, "--out", again).exit_code == 0
    assert (again / "model.safetensors").read_bytes() == (run / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    assert cli("train", *FAST_ARGS, *args, "--seed", "1", "--out", other).exit_code == 0
    assert (other / "model.safetensors").read_bytes() != (run / "model.safetensors").read_bytes()


def test_select_clients_is_reproducible_and_uniform_in_size():
    rounds = [select_clients(7, m, 5, 0.4) for m in range(20)]
    assert all(len(s) == 2 == len(set(s)) and s == sorted(s) and set(s) <= set(range(5)) for s in rounds)
    assert rounds == [select_clients(7, m, 5, 0.4) for m in range(20)]
    assert len({tuple(s) for s in rounds}) > 1  # a different draw per round
    assert select_clients(7, 0, 5, 1.0) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("p, k", [(0.28, 25), (0.07, 100), (0.7, 10), (0.14, 50)])
def test_select_clients_counts_are_not_inflated_by_rounding(p, k):
    # p * k is an integer mathematically, but e.g. 0.28 * 25 == 7.000000000000001 in floating point.
    assert len(select_clients(0, 0, k, p)) == round(p * k)


def test_effective_client_fraction_is_not_inflated_by_rounding(tmp_path, cli):
    out = tmp_path / "run"
    result = cli("train", *FAST_ARGS, "--model", "mlp", "--width", "8", "--rounds", "1", "--num-clients", "25",
                 "--partition", "iid", "--client-fraction", "0.28", "--out", out)
    assert result.exit_code == 0, result.output
    assert read_json(out / "manifest.json")["clients"]["client_fraction_effective"] == pytest.approx(0.28)
    assert pd.read_csv(out / "metrics.csv")["clients"].tolist() == [7]


# ---------------------------------------------------------------------------- fedaudit epsilon


def _table(stdout: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^\s*\d+\s+(\S+)\s*$", stdout, flags=re.M)]


@pytest.mark.parametrize(
    "sigma, q, t, m, p, delta, accountant",
    [(1.0, 0.0256, 200, 15, 1.0, 1e-5, "rdp"), (0.8, 0.05, 20, 6, 0.4, 1e-6, "rdp"), (1.2, 0.1, 10, 4, 0.5, 1e-5, "prv")],
)
def test_epsilon_command_prints_the_accountants_values(cli, sigma, q, t, m, p, delta, accountant):
    result = cli("epsilon", "--noise-multiplier", sigma, "--sample-rate", q, "--steps", t, "--rounds", m,
                 "--client-fraction", p, "--delta", delta, "--accountant", accountant)
    assert result.exit_code == 0, result.output
    expected = epsilon_per_round(noise_multiplier=sigma, sample_rate=q, queries_per_round=t, rounds=m,
                                 client_fraction=p, delta=delta, accountant=accountant)
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == f"epsilon={float(lines[-1].split('=')[1]):.6g}"
    assert float(lines[-1].split("=")[1]) == pytest.approx(expected[-1], rel=1e-5)
    assert _table(result.stdout) == pytest.approx(expected, rel=1e-5)
    assert f"accountant={accountant}" in lines[0]


def test_epsilon_command_defaults(cli):
    eps = epsilon_cli(cli, "--noise-multiplier", "1", "--sample-rate", "0.0256", "--steps", "200", "--rounds", "15")
    expected = epsilon_per_round(noise_multiplier=1.0, sample_rate=0.0256, queries_per_round=200, rounds=15,
                                 client_fraction=1.0, delta=1e-5, accountant="rdp")[-1]
    assert eps == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("target, accountant, q, t, m, p", [(4.0, "rdp", 0.05, 20, 5, 0.5), (2.5, "rdp", 0.05, 20, 5, 0.5),
                                                             (2.0, "prv", 0.2, 2, 2, 1.0)])
def test_epsilon_command_with_target_prints_the_noise_multiplier(cli, target, accountant, q, t, m, p):
    common = dict(sample_rate=q, queries_per_round=t, rounds=m, client_fraction=p, delta=1e-5, accountant=accountant)
    result = cli("epsilon", "--target-epsilon", target, "--sample-rate", q, "--steps", t, "--rounds", m,
                 "--client-fraction", p, "--accountant", accountant)
    assert result.exit_code == 0, result.output
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("noise_multiplier=")
    printed = float(last.split("=", 1)[1])
    assert printed == pytest.approx(calibrate_noise_multiplier(target_epsilon=target, **common), rel=1e-5)
    # The printed sigma, used as printed, stays within the budget.
    assert epsilon_per_round(noise_multiplier=printed, **common)[-1] <= target
    assert _table(result.stdout)[-1] <= target


BAD_EPSILON = {
    "zero-rate": ["--noise-multiplier", "1", "--sample-rate", "0", "--steps", "10", "--rounds", "2"],
    "rate-above-one": ["--noise-multiplier", "1", "--sample-rate", "1.5", "--steps", "10", "--rounds", "2"],
    "zero-steps": ["--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "0", "--rounds", "2"],
    "zero-rounds": ["--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--rounds", "0"],
    "negative-sigma": ["--noise-multiplier", "-1", "--sample-rate", "0.1", "--steps", "10", "--rounds", "2"],
    "nan-sigma": ["--noise-multiplier", "nan", "--sample-rate", "0.1", "--steps", "10", "--rounds", "2"],
    "zero-delta": ["--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--rounds", "2", "--delta", "0"],
    "delta-one": ["--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--rounds", "2", "--delta", "1"],
    "zero-fraction": ["--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--rounds", "2",
                      "--client-fraction", "0"],
    "both": ["--noise-multiplier", "1", "--target-epsilon", "3", "--sample-rate", "0.1", "--steps", "10", "--rounds", "2"],
    "neither": ["--sample-rate", "0.1", "--steps", "10", "--rounds", "2"],
    "zero-target": ["--target-epsilon", "0", "--sample-rate", "0.1", "--steps", "10", "--rounds", "2"],
    "unreachable-target": ["--target-epsilon", "0.01", "--sample-rate", "0.1", "--steps", "10", "--rounds", "2"],
}


@pytest.mark.parametrize("args", list(BAD_EPSILON.values()), ids=list(BAD_EPSILON))
def test_epsilon_command_user_errors(cli, args):
    result = cli("epsilon", *args)
    assert_user_error(result)
    assert result.stdout == ""


# ---------------------------------------------------------------------------- fedaudit datasets


def _write_idx(path: Path, array: np.ndarray) -> None:
    code = {np.dtype(np.uint8): 0x08}[array.dtype]
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    path.write_bytes(header + array.tobytes())


def test_datasets_lists_where_each_dataset_was_found(tmp_path, cli):
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for split, n in (("train", 12), ("t10k", 7)):
        _write_idx(raw / f"{split}-images-idx3-ubyte", np.zeros((n, 28, 28), dtype=np.uint8))
        _write_idx(raw / f"{split}-labels-idx1-ubyte", np.zeros(n, dtype=np.uint8))
    result = cli("datasets", "--data-dir", tmp_path / "data")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert {"digits", "fashion-mnist", "mnist", "cifar10"} <= set(rows)
    assert "scikit-learn (bundled)" in rows["digits"] and "1437" in rows["digits"]
    assert str(raw) in rows["fashion-mnist"]
    assert re.search(r"\b12\s+7\b", rows["fashion-mnist"])  # sizes read from the IDX headers
    assert str(tmp_path) not in rows["mnist"] and "--data-dir" in rows["mnist"]  # not found: how to get it

    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("datasets", "--data-dir", empty)
    assert result.exit_code == 0, result.output
    fashion = next(line for line in result.stdout.splitlines() if line.startswith("fashion-mnist"))
    assert str(empty) not in fashion and "<NA>" in fashion

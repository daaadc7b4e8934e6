"""``fedaudit train``: resume, user errors, --config and --target-epsilon."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import (
    FAST_ARGS,
    assert_same_tensors,
    assert_user_error,
    client_plan,
    interrupt_in_round,
    read_json,
    tree_digest,
    without_wall,
)

from fedaudit.privacy.accounting import calibrate_noise_multiplier

# ---------------------------------------------------------------------------- resume


@pytest.mark.parametrize("dp", [False, True], ids=["plain", "dp"])
def test_resume_after_interrupt_equals_an_uninterrupted_run(tmp_path, monkeypatch, trained, cli, dp, fixed_secrets):
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
    pd.testing.assert_frame_equal(
        without_wall(pd.read_csv(out / "metrics.csv")), without_wall(pd.read_csv(reference / "metrics.csv"))
    )
    if dp:
        assert read_json(out / "privacy.json") == read_json(reference / "privacy.json")
    else:
        assert not (out / "privacy.json").exists()


def test_resume_after_interrupt_between_the_round_files(tmp_path, monkeypatch, dp_run, cli, fixed_secrets):
    """Ctrl-C after privacy.json but before manifest.json (the commit point) was written for round 2."""
    from fedaudit.rundir import RunDirectory

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


def test_a_start_interrupted_in_the_first_round_leaves_nothing(tmp_path, monkeypatch, plain_run, cli):
    """A new run appears at --out with its first committed round: interrupted before, it leaves nothing (not even
    its temporary directory), so the same command again trains it from the start."""
    interrupt_in_round(monkeypatch, 1)
    out = tmp_path / "run"
    assert cli("train", *FAST_ARGS, "--rounds", "3", "--out", out).exit_code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert_user_error(cli("train", "--resume", out, "--no-progress"), mentions="not a directory")
    monkeypatch.undo()
    assert cli("train", *FAST_ARGS, "--rounds", "3", "--out", out).exit_code == 0
    assert (out / "model.safetensors").read_bytes() == (plain_run / "model.safetensors").read_bytes()


def test_resume_with_more_rounds_under_the_cosine_schedule_says_the_run_differs_from_a_planned_one(
    tmp_path, trained, cli
):
    out = tmp_path / "run"
    shutil.copytree(trained("--rounds", "2"), out)
    result = cli("train", "--resume", out, "--rounds", "3", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "Note: the cosine learning-rate schedule" in result.output and "was laid over 2 rounds" in result.output
    assert "round 3 follows one over 3, so the run will differ from one trained for 3 rounds" in result.output
    longer = trained("--rounds", "3")
    assert (out / "model.safetensors").read_bytes() != (longer / "model.safetensors").read_bytes()  # as it says


def test_resume_with_more_rounds_extends_a_complete_run(tmp_path, trained, cli):
    # A constant learning rate: with the cosine schedule the horizon M changes the step sizes.
    dp_run = trained("--dp", "--rounds", "3", "--lr-schedule", "constant")
    out = tmp_path / "run"
    shutil.copytree(trained("--dp", "--rounds", "2", "--lr-schedule", "constant"), out)
    before = read_json(out / "privacy.json")
    assert len(before["epsilon_per_round"]) == 2

    result = cli("train", "--resume", out, "--rounds", "3", "--no-progress")
    assert result.exit_code == 0, result.output
    assert "cosine" not in result.output  # a constant rate extends a run as if it had been planned
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
    [
        ["--dp"],
        ["--lr", "0.5"],
        ["--seed", "1"],
        ["--out", "OTHER"],
        ["--config", "CONFIG"],
        ["--overwrite"],
        ["--rounds", "2"],
        ["--rounds", "0"],
    ],
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
    assert_user_error(
        cli("train", "--resume", out, "--rounds", "4", "--device", "cuda", "--no-progress"), mentions="cuda"
    )
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
    "seed-beyond-32-bits": (["--seed", str(2**32)], "--seed"),
    "missing-config": (["--config", "NOWHERE/config.yaml"], "config"),
    "malformed-yaml": (["--config", "FILE:bad.yaml:federated: [rounds: 3"], "yaml"),
    "malformed-json": (["--config", 'FILE:bad.json:{"federated": '], "json"),
    "binary-config": (["--config", "FILE:bin.yaml:\udcff\udcfe\x00\x00"], "config"),
    "unknown-section": (["--config", "FILE:c.yaml:optimiser:\n  lr: 0.1\n"], "optimiser"),
    "unknown-key": (["--config", "FILE:c.yaml:federated:\n  learning_rate: 0.1\n"], "learning_rate"),
    "not-a-mapping": (["--config", "FILE:c.yaml:- 1\n- 2\n"], "mapping"),
    "section-not-a-mapping": (["--config", "FILE:c.yaml:data: digits\n"], "data"),
    "bad-value-in-config": (
        ["--config", 'FILE:c.json:{"federated": {"client_fraction": "half"}}'],
        "--client-fraction",
    ),
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
    result = cli("train", *FAST_ARGS, "--rounds", "1", "--out", out)  # no fix that would fail is suggested
    assert_user_error(result)
    assert "is a non-empty directory that is not a fedaudit run; choose another --out" in result.output
    assert "--resume" not in result.output and "--overwrite" not in result.output
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
    content = {
        "seed": 3,
        "model": {"arch": "mlp", "width": 16, "depth": 1},
        "federated": {"rounds": 4, "batch_size": 64, "local_epochs": 1, "lr_schedule": "cosine"},
        "privacy": {"dp": True, "noise_multiplier": 2.0},
    }
    path = tmp_path / f"config.{suffix}"
    if suffix == "json":
        path.write_text(json.dumps(content))
    else:
        import yaml

        path.write_text(yaml.safe_dump(content))
    out = tmp_path / "run"
    result = cli(
        "train",
        "--config",
        path,
        "--rounds",
        "1",
        "--noise-multiplier",
        "1.5",
        "--width",
        "8",
        "--no-progress",
        "--out",
        out,
    )
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
def test_written_config_reproduces_the_run(request, tmp_path, cli, which, fixed_secrets):
    """With its clients' secrets (a DP run's noise comes from them, not from the configuration)."""
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


def test_target_epsilon_calibrates_sigma(tmp_path, trained, cli, fixed_secrets):
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
    ((q, t),) = set(client_plan(run).values())
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


def test_target_epsilon_with_partial_participation_meets_the_target_for_the_rounds_taken_part_in(trained):
    from fedaudit.preparation import select_clients

    target, rounds = 3.0, 4
    equal = ("--partition", "iid", "--num-clients", "4", "--client-fraction", "0.5")
    run = trained("--dp", "--rounds", str(rounds), *equal, "--target-epsilon", str(target))
    ledger = read_json(run / "privacy.json")
    taking_part = {k: sum(k in select_clients(0, m, 4, 0.5) for m in range(rounds)) for k in range(4)}
    busiest = max(taking_part.values())
    assert busiest < rounds  # no client took part in every round: calibrating for every round would waste budget
    ((q, t),) = set(client_plan(run).values())
    sigma = read_json(run / "config.json")["privacy"]["noise_multiplier"]
    expected = calibrate_noise_multiplier(target_epsilon=target, sample_rate=q, queries_per_round=t, rounds=busiest)
    assert sigma == pytest.approx(expected, rel=1e-12)
    assert 0.98 * target <= ledger["epsilon_per_round"][-1] <= target
    for k, rounds_in in taking_part.items():
        assert sum(str(k) in row for row in ledger["history"]["rounds"]) == rounds_in


def test_a_diverging_run_stops_with_one_sentence_and_keeps_its_rounds(tmp_path, cli):
    from helpers import FAST_ARGS, assert_user_error

    out = tmp_path / "run"
    line = assert_user_error(
        cli("train", *FAST_ARGS, "--rounds", "3", "--lr", "1e20", "--out", out), mentions="diverged"
    )
    assert "--lr" in line
    if "nothing is kept" in line:  # diverged in its first round: a new run that never committed leaves nothing
        assert list(tmp_path.iterdir()) == []
    else:
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["status"] == "failed" and manifest["rounds_done"] < 3


def test_a_dp_run_whose_noise_makes_its_outputs_overflow_stops_and_names_the_noise(tmp_path, cli):
    """sigma 1e25 leaves the weights finite (about 1e23) but the outputs overflow: the run was saved and reported with
    an accuracy beside a NaN loss, and the attack then said its weights were not finite."""
    from helpers import FAST_ARGS, assert_user_error

    out = tmp_path / "run"
    line = assert_user_error(
        cli("train", *FAST_ARGS, "--dp", "--noise-multiplier", "1e25", "--rounds", "2", "--out", out),
        mentions="diverged",
    )
    assert "test loss is no longer finite" in line and "--noise-multiplier 1e+25 with a clipping norm of" in line
    assert list(tmp_path.iterdir()) == []  # its first round: nothing is kept


def test_options_complete_a_configuration_file_before_it_is_validated(tmp_path, cli):
    """A file that sets sigma and the option that turns DP on: valid together, so it trains (the file alone is not)."""
    config = tmp_path / "c.yaml"
    config.write_text("privacy:\n  noise_multiplier: 2\n")
    result = cli("train", *FAST_ARGS, "--rounds", "1", "--dp", "--config", config, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert read_json(tmp_path / "run" / "config.json")["privacy"]["noise_multiplier"] == 2
    assert_user_error(cli("train", *FAST_ARGS, "--config", config, "--out", tmp_path / "other"))

"""The training core through ``fedaudit train``: the run directory it writes, the ledger, client selection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import opacus
import pandas as pd
import pytest
import torch
from helpers import (
    FAST_ARGS,
    assert_same_tensors,
    assert_user_error,
    client_plan,
    epsilon_cli,
    invoke,
    read_json,
)
from safetensors.torch import load_file

import fedaudit
from fedaudit.config import RunConfig
from fedaudit.data import load_dataset
from fedaudit.preparation import TrainingError, select_clients
from fedaudit.privacy.accounting import epsilon_per_round
from fedaudit.rundir import METRIC_COLUMNS

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
    assert stored["data"] == {
        "dataset": "digits",
        "data_dir": None,
        "download": False,
        "partition": "classes:2",
        "num_clients": 5,
        "holdout_fraction": 0.1,
        "label_column": None,
        "image_size": None,
        "sites": [],
    }
    assert stored["keep_checkpoints"] is None
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
    assert "torch_cpu_rng_state" not in state  # the calling process's global generator: nothing of the run


def test_privacy_json_agrees_with_metrics_and_the_epsilon_command(dp_run, cli):
    ledger = read_json(dp_run / "privacy.json")
    assert {"accountant", "delta", "noise_multiplier", "max_grad_norm", "entries", "epsilon_per_round"} <= set(ledger)
    assert (ledger["accountant"], ledger["delta"], ledger["noise_multiplier"], ledger["max_grad_norm"]) == (
        "rdp",
        1e-5,
        1.0,
        1.0,
    )
    metrics = pd.read_csv(dp_run / "metrics.csv")
    assert metrics["epsilon"].tolist() == pytest.approx(ledger["epsilon_per_round"], rel=1e-12)

    # The ledger reports the worst client; its entries are all M rounds of its T queries at q = B / N_k.
    plan = client_plan(dp_run)
    worst = max(
        plan,
        key=lambda k: epsilon_per_round(
            noise_multiplier=1.0, sample_rate=plan[k][0], queries_per_round=plan[k][1], rounds=3
        )[-1],
    )
    q, t = plan[worst]
    assert ledger["entries"] == [{"noise_multiplier": 1.0, "sample_rate": pytest.approx(q, rel=1e-12), "steps": 3 * t}]
    assert sum(e["steps"] for e in ledger["entries"]) == 3 * t

    eps = epsilon_cli(cli, "--noise-multiplier", "1.0", "--sample-rate", repr(q), "--steps", t, "--rounds", 3)
    assert eps == pytest.approx(ledger["epsilon_per_round"][-1], rel=1e-5)


def test_a_run_never_reports_less_epsilon_than_any_client_spent(dp_run):
    ledger = read_json(dp_run / "privacy.json")
    reported = ledger["epsilon_per_round"]
    spent = np.array(
        [
            epsilon_per_round(noise_multiplier=1.0, sample_rate=q, queries_per_round=t, rounds=3)
            for q, t in client_plan(dp_run).values()
        ]
    )
    assert np.all(np.asarray(reported) >= spent.max(axis=0) * (1 - 1e-12))
    assert reported == pytest.approx(spent.max(axis=0).tolist(), rel=1e-9)
    summary = pd.read_csv(dp_run / "metrics.csv")["epsilon"].iloc[-1]
    assert summary >= spent.max() * (1 - 1e-12)


# ---------------------------------------------------------------------------- client selection


def test_partial_participation_charges_the_rounds_a_client_takes_part_in_in_full(tmp_path, trained, cli, fixed_secrets):
    args = ("--dp", "--rounds", "3", "--client-fraction", "0.3")  # ceil(0.3 * 5) = 2 clients, p_eff = 0.4
    run = trained(*args)
    manifest = read_json(run / "manifest.json")
    assert manifest["clients"]["client_fraction_effective"] == pytest.approx(0.4)
    metrics = pd.read_csv(run / "metrics.csv")
    assert metrics["clients"].tolist() == [2, 2, 2]
    num_parameters = manifest["model"]["num_parameters"]
    assert (metrics["bytes_up"] == 2 * 4 * num_parameters).all()

    ledger = read_json(run / "privacy.json")
    plan = client_plan(run)
    selected = [select_clients(0, m, 5, 0.4) for m in range(3)]
    taking_part = {k: sum(k in s for s in selected) for k in plan}
    assert sorted(set(taking_part.values())) != [3]  # the seed makes some client sit a round out
    for k, (q, t) in plan.items():  # charged for the rounds it took part in, every query at q
        rounds = taking_part[k]
        entries = ledger["per_client"].get(str(k), {"entries": []})["entries"]
        expected = [{"noise_multiplier": 1.0, "sample_rate": pytest.approx(q, rel=1e-12), "steps": rounds * t}]
        assert entries == (expected if rounds else [])
        if rounds:
            eps = epsilon_cli(
                cli, "--noise-multiplier", "1", "--sample-rate", repr(q), "--steps", t, "--rounds", rounds
            )
            assert eps == pytest.approx(ledger["per_client"][str(k)]["epsilon"], rel=1e-5)
    for m, row in enumerate(ledger["history"]["rounds"]):
        assert sorted(int(k) for k in row) == selected[m]

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
    result = cli(
        "train",
        *FAST_ARGS,
        "--model",
        "mlp",
        "--width",
        "8",
        "--rounds",
        "1",
        "--num-clients",
        "25",
        "--partition",
        "iid",
        "--client-fraction",
        "0.28",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    assert read_json(out / "manifest.json")["clients"]["client_fraction_effective"] == pytest.approx(0.28)
    assert pd.read_csv(out / "metrics.csv")["clients"].tolist() == [7]


def test_evaluation_every_k_rounds_on_a_fixed_sample_changes_only_what_is_measured(tmp_path):
    """--eval-every 2 measures rounds 2, 4 and the last; --eval-sample 50 measures on 50 test records, which the
    report's interval counts; the model trained is the same as with every round measured on every record."""
    from fedaudit.attacks.metrics import rate_interval
    from fedaudit.reports.collect import collect_runs

    every, sampled = tmp_path / "every", tmp_path / "sampled"
    base = (*FAST_ARGS, "--rounds", "5")
    assert invoke("train", *base, "--out", every).exit_code == 0
    result = invoke("train", *base, "--eval-every", "2", "--eval-sample", "50", "--out", sampled)
    assert result.exit_code == 0 and "round 3/5: not evaluated (--eval-every)" in result.output
    assert (sampled / "model.safetensors").read_bytes() == (every / "model.safetensors").read_bytes()
    rows = pd.read_csv(sampled / "metrics.csv")
    assert rows["test_accuracy"].isna().tolist() == [True, False, True, False, False]
    measured = rows["test_accuracy"].dropna() * 50
    assert np.allclose(measured, measured.round())  # right answers out of 50
    (run,) = collect_runs([sampled])
    assert run.test_records == 50
    assert list(run.final_accuracy_ci) == list(rate_interval(round(run.final_accuracy * 50), 50))


@pytest.mark.parametrize(
    "extra, mentions",
    [(("--eval-every", "0"), "--eval-every"), (("--eval-sample", "-3"), "--eval-sample")],
)
def test_bad_evaluation_settings_are_one_sentence(tmp_path, extra, mentions):
    assert_user_error(invoke("train", *FAST_ARGS, *extra, "--out", tmp_path / "run"), mentions=mentions)
    assert not (tmp_path / "run").exists()


def test_a_deployed_run_stopped_in_a_round_resumes_with_the_rounds_it_was_sent_with(dp_run, plain_run):
    """A site answers a round once, for one set of inputs (the rounds among them): resumed with other --rounds after a
    failed round, the sites that had not answered it answered for the new rounds, the others refused, and no --rounds
    ever suited them all again. Such a resume is refused before anything is sent; a complete run is extended, and a
    run whose noise is not the sites' secret (nothing recorded at the sites) is resumed as asked."""
    from dataclasses import replace as swap

    from fedaudit.rundir import RunDirectory
    from fedaudit.training import _refuse_new_rounds_for_a_round_in_flight

    run = RunDirectory(dp_run)
    manifest, config = run.read_manifest(), run.read_run_config()
    deployed = swap(config, engine="flower", flower=swap(config.flower, superlink="127.0.0.1:9092"))
    stopped = swap(manifest, status="failed")
    planned = config.federated.rounds
    with pytest.raises(TrainingError, match=f"resume it with --rounds {planned} \\(or none\\), then extend it"):
        _refuse_new_rounds_for_a_round_in_flight(run, stopped, deployed, planned + 1, None)
    for rounds in (None, planned):
        _refuse_new_rounds_for_a_round_in_flight(run, stopped, deployed, rounds, None)
    _refuse_new_rounds_for_a_round_in_flight(run, manifest, deployed, planned + 1, None)  # complete: extended
    _refuse_new_rounds_for_a_round_in_flight(run, stopped, config, planned + 1, None)  # the local engine
    plain = RunDirectory(plain_run)
    plain_config = plain.read_run_config()
    deployed_plain = swap(plain_config, engine="flower", flower=swap(plain_config.flower, superlink="h:1"))
    _refuse_new_rounds_for_a_round_in_flight(
        plain, swap(plain.read_manifest(), status="failed"), deployed_plain, 9, None
    )

"""FedLAP and FedLAP-DP end to end through the CLI on digits (small settings, seconds)."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from helpers import FAST_ARGS, assert_same_tensors, assert_user_error, interrupt_in_round, read_json, without_wall
from safetensors.torch import load_file

LAP_ARGS = tuple(
    (
        "--algorithm fedlap --ipc 2 --trajectories 2 --max-loops 2 --real-batches 2 --image-steps 2 "
        "--model-epochs 1 --server-epochs 5 --rounds 2"
    ).split()
)


@pytest.mark.parametrize("dp", [False, True], ids=["fedlap", "fedlap-dp"])
def test_fedlap_trains_accounts_and_resumes_exactly(tmp_path, monkeypatch, cli, dp, fixed_secrets):
    args = [*FAST_ARGS, *LAP_ARGS, "--save-transmitted", "--init", "previous", *(["--dp"] if dp else [])]
    reference = tmp_path / "reference"
    result = cli("train", *args, "--out", reference)
    assert result.exit_code == 0, result.output
    metrics = pd.read_csv(reference / "metrics.csv")
    assert list(metrics["round"]) == [1, 2]
    assert {"server_radius", "server_iterations", "matching_loss_first", "cost_vs_model"} <= set(metrics.columns)
    config = read_json(reference / "config.json")
    assert config["federated"]["algorithm"] == "fedlap" and config["fedlap"]["ipc"] == 2
    # what crossed the wire: 5 clients x 2 classes x ipc images per round, stored as safetensors
    sent = load_file(str(reference / "transmitted" / "round-0001" / "client-000.safetensors"))
    assert sent["images"].shape == (4, 1, 8, 8) and sorted(set(sent["labels"].tolist())) == sorted(
        sent["labels"].unique().tolist()
    )
    assert len(list((reference / "transmitted").glob("round-*/client-*.safetensors"))) == 10
    assert metrics["bytes_up"].iloc[0] == sum(
        sum(t.numel() * t.element_size() for t in load_file(str(p)).values())
        for p in (reference / "transmitted" / "round-0001").glob("*.safetensors")
    )
    if dp:
        ledger = read_json(reference / "privacy.json")
        assert all(entry["steps"] == 2 * (2 * 2 * 2) for entry in ledger["entries"])  # M * R_i * L * R_b
        assert list(metrics["epsilon"]) == pytest.approx(ledger["epsilon_per_round"], rel=1e-14)
        assert config["privacy"]["max_grad_norm"] == 1.0
    else:
        assert not (reference / "privacy.json").exists()
        assert (metrics["server_radius"] <= 10.0).all()

    out = tmp_path / "interrupted"
    interrupt_in_round(monkeypatch, 2)
    assert cli("train", *args, "--out", out).exit_code == 1
    monkeypatch.undo()
    result = cli("train", "--resume", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert_same_tensors(out / "model.safetensors", reference / "model.safetensors")
    pd.testing.assert_frame_equal(without_wall(pd.read_csv(out / "metrics.csv")), without_wall(metrics))
    if dp:
        assert read_json(out / "privacy.json") == read_json(reference / "privacy.json")


def test_fedlap_dp_refuses_real_initialisation(tmp_path, cli):
    out = tmp_path / "run"
    result = cli("train", *FAST_ARGS, *LAP_ARGS, "--dp", "--init", "real", "--out", out)
    assert_user_error(result, mentions="--init real")
    assert not out.exists()


def test_equal_data_access_prints_the_matching_fedavg_settings(cli):
    result = cli("train", *FAST_ARGS, *LAP_ARGS, "--dp", "--equal-data-access")
    assert result.exit_code == 0, result.output
    assert "at most 8 DP queries per client per round" in result.output
    assert "--local-steps 8" in result.output
    # the clients differ in size: each number of batches per epoch, and the epochs' queries, as a range
    found = re.search(r"clients of (\d+) to (\d+) records, (\d+) to (\d+) batches per epoch", result.output)
    assert found, result.output
    smallest, largest, few, many = map(int, found.groups())
    batch = int(FAST_ARGS[FAST_ARGS.index("--batch-size") + 1])
    assert (few, many) == (smallest // batch, largest // batch) and few < many
    epochs = max(1, round(8 / many))
    assert f"--local-epochs {epochs} = {epochs * few} to {epochs * many} queries" in result.output

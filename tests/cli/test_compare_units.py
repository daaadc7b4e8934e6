"""A study that mixes record-level and client-level budgets: each run states its unit, the comparison never ranks the
two units on one scale, algorithms without a client level are not trained at a client-level budget (and the plan
says so), and a client-level budget without its clipping norm is one sentence."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml
from helpers import invoke

from fedaudit.study import Budget, Study, StudyError, plan

BASE = {"data": {"dataset": "digits"}, "model": {"arch": "mlp", "width": 16, "depth": 1}, "device": "cpu"}
FEDLAP = {"ipc": 2, "trajectories": 1, "max_loops": 2, "real_batches": 2, "image_steps": 2, "model_epochs": 1}


def test_client_budgets_parse_print_and_name_their_runs() -> None:
    budget = Budget.parse(" Client:eps:8 ")
    assert budget == Budget("epsilon", 8.0, "client") and str(budget) == "client:epsilon:8"
    assert budget.slug == "client-eps8" and Budget.parse("client:sigma:1.5").slug == "client-sigma1.5"
    assert Budget.parse(str(budget)) == budget and Budget.parse("epsilon:8").level == "record"
    for bad in ("client:none", "client:", "client:epsilon:-1", "clients:epsilon:8"):
        with pytest.raises(StudyError):
            Budget.parse(bad)


def test_the_plan_trains_client_budgets_only_where_an_algorithm_has_a_client_level() -> None:
    study = Study(
        algorithms=("fedavg", "fedlap"),
        budgets=(Budget.parse("epsilon:8"), Budget.parse("client:epsilon:8")),
        max_update_norm=0.5,
    )
    runs = {run.name: run.config.privacy for run in plan(study)}
    assert sorted(runs) == ["fedavg-client-eps8-seed0", "fedavg-eps8-seed0", "fedlap-eps8-seed0"]
    client = runs["fedavg-client-eps8-seed0"]
    assert (client.dp_level, client.max_update_norm, client.max_grad_norm) == ("client", 0.5, None)
    assert runs["fedavg-eps8-seed0"].dp_level == "record"


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"max_update_norm": None}, "needs --max-update-norm"),
        ({"max_update_norm": -1.0}, "needs --max-update-norm"),
        ({"algorithms": ("fedlap",)}, "No algorithm of the study has a client level"),
    ],
)
def test_a_client_budget_that_cannot_train_is_one_sentence(changes, says) -> None:
    base = {"algorithms": ("fedavg",), "budgets": (Budget.parse("client:sigma:1"),), "max_update_norm": 1.0}
    with pytest.raises(StudyError, match=says):
        Study(**{**base, **changes}).validate()


def test_a_study_across_units_states_each_runs_unit_and_never_ranks_them_together(tmp_path) -> None:
    study = {
        "algorithms": ["fedavg", "fedlap"],
        "budgets": ["sigma:1", "client:sigma:1"],
        "max_update_norm": 0.5,
        "seeds": [0],
        "base": {**BASE, "federated": {"rounds": 1, "batch_size": 32}, "fedlap": {**FEDLAP, "server_epochs": 5}},
        "attack": {"signals": ["loss"], "methods": ["threshold"], "max_records": 200, "bootstrap": 50},
        "report": {"formats": ["md"]},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    result = invoke("compare", "--study", str(path), "--out", str(tmp_path / "out"), "--no-progress")
    assert result.exit_code == 0, result.output
    assert "Not trained: fedlap at client:sigma:1 (it has no client level)." in result.output
    runs = sorted(p.name for p in (tmp_path / "out" / "runs").iterdir())
    assert runs == ["fedavg-client-sigma1-seed0", "fedavg-sigma1-seed0", "fedlap-sigma1-seed0"]
    ledger = json.loads((tmp_path / "out" / "runs" / "fedavg-client-sigma1-seed0" / "privacy.json").read_text())
    assert ledger["unit"] == "client"
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    row = summary[summary["run"] == "fedavg-client-sigma1-seed0"].iloc[0]
    assert (row["algorithm"], row["budget"]) == ("DP-FedAvg (client level)", "sigma 1 per client")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "These runs protect two units" in text
    assert "Test accuracy at sigma 1 per client" not in text  # one algorithm there: nothing to rank
    assert (
        "Test accuracy at sigma 1:" in text
        and "DP-FedAvg (client level)" not in text.split("Test accuracy at sigma 1:")[1].split("\n")[0]
    )

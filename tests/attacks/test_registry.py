"""The attack registry: every entry's implementation is where it says, the command line and the runner take their
lists from it, and a new membership attack is one function and one entry (planted here, run end to end)."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import invoke

import fedaudit.attacks.registry as registry
from fedaudit.attacks.membership.methods import MethodOutput
from fedaudit.attacks.registry import ATTACKS, CANARY, CLIENT, MEMBERSHIP, RECONSTRUCTION, REFERENCE, AttackEntry
from fedaudit.attacks.runner import AttackOptions, expected_results
from fedaudit.rundir import RunDirectory

MEMBERSHIP_PARAMETERS = ["signal", "score", "member", "attack_train", "seed"]


@pytest.mark.parametrize("name", list(ATTACKS))
def test_every_entry_loads_its_implementation(name: str) -> None:
    entry = ATTACKS[name]
    assert entry.name == name and entry.family in (MEMBERSHIP, REFERENCE, CANARY, RECONSTRUCTION, CLIENT)
    function = entry.load()
    assert callable(function)
    parameters = list(inspect.signature(function).parameters)
    if entry.family == MEMBERSHIP:
        assert parameters[:5] == MEMBERSHIP_PARAMETERS
    if entry.family == REFERENCE:
        assert parameters == ["compared", "signal", "target"]
    assert entry.summary and entry.needs and entry.writes


def test_the_defaults_and_the_known_methods_come_from_the_registry() -> None:
    assert AttackOptions().methods == tuple(n for n, e in ATTACKS.items() if e.default) == ("threshold", "classifier")
    result = invoke("attack", "nowhere", "--method", "nope")
    assert result.exit_code == 2
    assert f"choose from {', '.join(ATTACKS)}" in result.output
    help_text = " ".join(invoke("attack", "--help").output.split())
    for name in ATTACKS:
        assert name in help_text, name


def negated(signal: np.ndarray, score: np.ndarray, member: np.ndarray, attack_train: np.ndarray, *, seed: int):
    """A planted attack: the signal's opposite (an attack that always guesses wrong on a leaking model)."""
    return MethodOutput(scores=-score, audit=np.ones(score.size, dtype=bool))


def test_a_new_membership_attack_is_one_function_and_one_entry(plain_run: Path, tmp_path: Path, monkeypatch) -> None:
    entry = AttackEntry(
        "negated",
        MEMBERSHIP,
        "the oriented signal's opposite",
        "the run's records",
        "<signal>-negated[-round-N]",
        f"{__name__}:negated",
    )
    monkeypatch.setitem(registry.ATTACKS, "negated", entry)
    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    args = ("--signal", "loss", "--method", "threshold", "--method", "negated", "--max-records", "200")
    result = invoke("attack", run, *args, "--bootstrap", "50", "--no-progress")
    assert result.exit_code == 0, result.output
    options = AttackOptions(signals=("loss",), methods=("threshold", "negated"), max_records=200, resamples=50)
    assert expected_results(RunDirectory(run), options) == {"loss-threshold": 3, "loss-negated": 3}
    threshold = json.loads((run / "attacks" / "loss-threshold" / "metrics.json").read_text())
    planted = json.loads((run / "attacks" / "loss-negated" / "metrics.json").read_text())
    assert planted["method"] == "negated"
    assert planted["auc"] == pytest.approx(1 - threshold["auc"], abs=1e-9)

"""Extending fedaudit: a toy algorithm (tests/support/toy_algorithm.py) and a toy attack (this file stands for its
module), each one module and one registry entry, go through a whole study (train, attack, report, compare) like the
built-in ones. The command line's choices are fixed when it loads, so the study runs through the Python API, as a
plug-in's user would run it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import toy_algorithm
import yaml

import fedaudit
import fedaudit.attacks.registry as attack_registry
import fedaudit.registry as registry
from fedaudit.attacks.membership.methods import MethodOutput


def negated(signal: np.ndarray, score: np.ndarray, member: np.ndarray, attack_train: np.ndarray, *, seed: int):
    """The toy attack: the oriented signal's opposite (a membership attack that guesses wrong on a leaking model)."""
    return MethodOutput(scores=-score, audit=np.ones(score.size, dtype=bool))


ALGORITHM = toy_algorithm.ENTRY
ATTACK = attack_registry.AttackEntry(
    "negated",
    attack_registry.MEMBERSHIP,
    "the signal's opposite",
    "the run's records",
    "<signal>-negated",
    f"{__name__}:negated",
)


@pytest.fixture
def plugged() -> Iterator[None]:
    """The toy algorithm and attack registered as a plug-in registers them, and removed afterwards, pass or fail."""
    registry.register_algorithm(ALGORITHM)
    attack_registry.register_attack(ATTACK)
    yield
    registry.unregister_algorithm(ALGORITHM.name)
    attack_registry.unregister_attack(ATTACK.name)


def test_a_toy_algorithm_and_a_toy_attack_run_through_a_whole_study(tmp_path: Path, plugged: None) -> None:
    study = {
        "algorithms": ["fedavg-twice", "fedavg"],
        "budgets": ["epsilon:20"],
        "seeds": [0],
        "base": {
            "data": {"dataset": "digits"},
            "model": {"arch": "mlp", "width": 16, "depth": 1},
            "federated": {"rounds": 1, "batch_size": 32, "local_epochs": 1},
            "device": "cpu",
        },
        "attack": {"signals": ["loss"], "methods": ["threshold", "negated"], "max_records": 200, "bootstrap": 50},
        "report": {"formats": ["md"]},
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    out = tmp_path / "out"
    fedaudit.compare(tmp_path / "study.yaml", out)

    run = next((out / "runs").glob("fedavg-twice-*"))
    config = json.loads((run / "config.json").read_text())
    assert config["federated"]["algorithm"] == "fedavg-twice"
    assert (config["federated"]["client_lr"], config["privacy"]["max_grad_norm"]) == (0.3, 0.7)  # its entry's
    threshold, planted = (
        json.loads((run / "attacks" / f"loss-{m}" / "metrics.json").read_text()) for m in ("threshold", "negated")
    )
    assert planted["method"] == "negated" and planted["auc"] == pytest.approx(1 - threshold["auc"], abs=1e-9)
    comparison = "\n".join(p.read_text() for p in out.rglob("*.md"))
    assert "DP-FedAvgTwice" in comparison and "negated" in comparison


def test_the_registries_refuse_what_would_break_them_or_vanish_without_a_word() -> None:
    """A built-in entry is not replaced by accident, a name is one --algorithm or --method takes, an attack of no
    family the runner knows (it returned nothing) is refused, and an implementation that cannot be imported is one
    sentence when it is used."""
    built_in = registry.ALGORITHMS["fedavg"]
    with pytest.raises(registry.RegistryError, match="called 'fedavg' is registered already; pass replace=True"):
        registry.register_algorithm(built_in)
    with pytest.raises(registry.RegistryError, match="must be lower-case letters, digits and dashes"):
        registry.register_algorithm(dataclasses.replace(ALGORITHM, name="Fed Avg"))
    with pytest.raises(registry.RegistryError, match="dp_unit"):
        registry.register_algorithm(dataclasses.replace(ALGORITHM, dp_unit="records"))
    with pytest.raises(registry.RegistryError, match="not module:attribute"):
        attack_registry.register_attack(dataclasses.replace(ATTACK, implementation="negated"))
    with pytest.raises(registry.RegistryError, match="family 'bogus' is none of membership, reference"):
        attack_registry.register_attack(dataclasses.replace(ATTACK, family="bogus"))
    with pytest.raises(registry.RegistryError, match="cannot run by default"):
        attack_registry.register_attack(dataclasses.replace(ATTACK, default=True))
    assert ALGORITHM.name not in registry.ALGORITHMS and ATTACK.name not in attack_registry.ATTACKS
    missing = dataclasses.replace(ALGORITHM, implementation="no_such_module:Nothing")
    with pytest.raises(registry.RegistryError, match="'no_such_module:Nothing' cannot be imported"):
        missing.build(None)

"""The user's own model (--model package.module:factory), from a file outside the package: trained with DP through
the one DP primitive, attacked and reported like the built-in ones; what cannot be trained is one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FAST_ARGS, assert_user_error, invoke, read_json

from fedaudit.rundir import RunDirectory

MODULE = '''
import math
import torch
from torch import nn


class Scale(nn.Module):
    """A layer the layer-wise query has no closed form for."""

    def __init__(self, n):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.gain


def tiny(input_shape, num_classes):
    n = math.prod(input_shape)
    return nn.Sequential(nn.Flatten(), Scale(n), nn.Linear(n, 16), nn.Tanh(), nn.Linear(16, num_classes))


def grouped(input_shape, num_classes):
    c = input_shape[0]
    return nn.Sequential(nn.Conv2d(c, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * input_shape[1] * input_shape[2], num_classes))


def batch_norm(input_shape, num_classes):
    return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(num_classes))


def broken(input_shape, num_classes):
    raise ValueError("needs 3 channels")


def not_a_model(input_shape, num_classes):
    return "a string"


def frozen(input_shape, num_classes):
    return nn.Flatten()
'''


def _without(args: tuple[str, ...], options: tuple[str, ...]) -> list[str]:
    """``args`` less each of ``options`` and its value."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        else:
            kept.append(arg)
    return kept


BASE = _without(FAST_ARGS, ("--model", "--width", "--depth"))


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "site_models"
    folder.mkdir()
    (folder / "mymodels.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return folder


def test_a_users_model_trains_with_dp_is_attacked_and_reported(models, tmp_path):
    run = tmp_path / "run"
    result = invoke("train", *BASE, "--model", "mymodels:tiny", "--dp", "--rounds", "2", "--out", run)
    assert result.exit_code == 0, result.output
    assert result.output.count("'1' (Scale) are computed one example at a time") == 1  # said once, named
    assert read_json(run / "config.json")["model"]["arch"] == "mymodels:tiny"
    assert read_json(run / "manifest.json")["model"]["num_parameters"] == 64 + 64 * 16 + 16 + 16 * 10 + 10
    assert invoke("attack", run, "--no-progress").exit_code == 0
    assert invoke("report", run, "--out", tmp_path / "r.md").exit_code == 0
    assert "| model | mymodels:tiny (1274 parameters, built by the user's factory) |" in (tmp_path / "r.md").read_text()
    assert RunDirectory(run).seal.problems() == []
    grouped = invoke("train", *BASE, "--model", "mymodels:grouped", "--dp", "--rounds", "1", "--out", tmp_path / "g")
    assert grouped.exit_code == 0 and "one example at a time" not in grouped.output  # closed forms only


@pytest.mark.parametrize(
    ("factory", "mentions"),
    [
        ("mymodels:batch_norm", "'1' (BatchNorm2d) mixes the records of a batch"),
        ("mymodels:broken", "the factory raised ValueError: needs 3 channels"),
        ("mymodels:not_a_model", "returned a str, not a torch.nn.Module"),
        ("mymodels:frozen", "no trainable parameters"),
        ("mymodels:missing", "has no function missing"),
        ("nowhere_models:tiny", "cannot import nowhere_models"),
        ("mymodels:tiny:extra", "must be package.module:factory"),
        ("resnet", "Unknown model 'resnet'"),
    ],
)
def test_a_model_that_cannot_be_trained_is_one_sentence_and_writes_nothing(models, tmp_path, factory, mentions):
    assert_user_error(invoke("train", *BASE, "--model", factory, "--dp", "--out", tmp_path / "run"), mentions=mentions)
    assert not (tmp_path / "run").exists()


def test_a_run_whose_factory_cannot_be_imported_says_so(models, tmp_path, monkeypatch):
    run = tmp_path / "run"
    assert invoke("train", *BASE, "--model", "mymodels:tiny", "--rounds", "1", "--out", run).exit_code == 0
    monkeypatch.undo()  # the auditor's environment does not have the module
    import sys

    sys.modules.pop("mymodels", None)
    assert_user_error(invoke("attack", run, "--no-progress"), mentions="put the folder that holds it on PYTHONPATH")


def test_the_sensitivity_probe_runs_a_users_model(models, tmp_path):
    """verify --probe builds the user's model from its factory and probes the query on it: the Scale layer takes the
    whole-model path, the GroupNorm model the layer-wise one; both add each record's gradient clipped to C."""
    for factory in ("mymodels:tiny", "mymodels:grouped"):
        run = tmp_path / factory.split(":")[1]
        assert invoke("train", *BASE, "--model", factory, "--dp", "--rounds", "1", "--out", run).exit_code == 0
        result = invoke("verify", run, "--probe")
        assert result.exit_code == 0 and "PASS sensitivity" in result.output, result.output
        outcomes = read_json(run / "verification.json")["checks"][0]["details"]["outcomes"]
        cases = {o["case"] for o in outcomes}
        assert "a gradient record in 1.gain" in cases or "a gradient record in 0.weight" in cases

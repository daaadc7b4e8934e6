"""The Python API: the documentation page's example runs as written, the functions make what the commands make, the
estimators give known answers on scores from outside fedaudit, and ``import fedaudit`` stays quick."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST_ARGS, same_secrets
from scipy.optimize import brentq
from scipy.stats import norm

import fedaudit
from fedaudit import api
from fedaudit.attacks import AttackError
from fedaudit.config import ConfigError

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def page_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)


def test_the_page_runs_as_written_in_one_namespace(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    for block in page_blocks():
        exec(compile(block, str(PAGE), "exec"), namespace)
    printed = capsys.readouterr().out
    assert re.search(r"test accuracy 0\.\d+, epsilon 8\.00 after 2 rounds", printed), printed
    assert re.search(r"^loss-threshold: AUC 0\.\d+ \[0\.\d+, 0\.\d+\], epsilon >= \d", printed, re.MULTILINE), printed
    assert "dp-fedavg PASS" in printed
    assert (tmp_path / "reports" / "dp-fedavg" / "report.md").is_file()
    assert sorted(p.name for p in (tmp_path / "runs" / "dp-fedavg" / "attacks").iterdir()) == [
        "grad-norm-threshold",
        "loss-threshold",
    ]
    truth = gdp_epsilon_closed_form(1.0, 1e-5)
    one_run, gdp, estimate = namespace["one_run"], namespace["gdp"], namespace["estimate"]
    assert 0 < one_run.epsilon < truth and 0 < gdp.epsilon < truth  # bounds at 95% below the true epsilon
    assert estimate.ci95[0] <= truth <= estimate.ci95[1]
    assert f"{truth:.1f}" in PAGE.read_text(encoding="utf-8")  # the page's stated epsilon for mu = 1


def gdp_epsilon_closed_form(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at ``delta`` (Dong, Roth and Su 2019, Corollary 2.13), solved here with scipy."""

    def gap(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(gap, 0.0, 100.0)


def test_the_page_names_every_estimator_the_module_exports() -> None:
    named = set(re.findall(r"^\| `(\w+)\(", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE))
    estimators = {name for name in api.__all__ if name[0].islower() and name not in fedaudit.COMMANDS}
    assert named == estimators
    assert set(fedaudit.COMMANDS) <= set(api.__all__)


def test_train_and_attack_make_what_the_commands_make(tmp_path, cli) -> None:
    """The command line is a layer over the functions: the same settings give the same files."""
    args = ("--rounds", "2", "--dp")
    with same_secrets():
        assert cli("train", *FAST_ARGS, *args, "--out", tmp_path / "cli").exit_code == 0
    # FAST_ARGS as keyword arguments
    options = {"dataset": "digits", "model": "mlp", "width": 16, "depth": 1, "batch_size": 32, "local_epochs": 1}
    with same_secrets():
        made = fedaudit.train(out=tmp_path / "api", rounds=2, dp=True, device="cpu", echo=lambda line: None, **options)
    assert made.run_dir == tmp_path / "api" and made.rounds_done == 2
    for name in ("model.safetensors", "privacy.json", "membership.npz"):
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name
    attack = ("--signal", "loss", "--method", "threshold", "--max-records", "100", "--no-progress")
    assert cli("attack", tmp_path / "cli", *attack).exit_code == 0
    results = fedaudit.attack(tmp_path / "api", signals=["loss"], methods=["threshold"], max_records=100, echo=print)
    assert [r.name for r in results] == ["loss-threshold"]
    ours, theirs = (tmp_path / "api" / "attacks" / "loss-threshold", tmp_path / "cli" / "attacks" / "loss-threshold")
    for table in ("scores.csv", "roc.csv"):
        assert (ours / table).read_bytes() == (theirs / table).read_bytes(), table
    metrics = [json.loads((folder / "metrics.json").read_text()) for folder in (ours, theirs)]
    for written in metrics:  # when it was written and the run's path: what may differ
        assert written.pop("created") and written.pop("run")
    assert metrics[0] == metrics[1]


def test_a_setting_that_cannot_work_is_the_command_s_sentence() -> None:
    with pytest.raises(ConfigError, match=r"^--rounds must be a positive integer"):
        api.run_config(rounds=0)
    with pytest.raises(ConfigError, match=r"^No setting is called 'no_such_option'; the names are train's options"):
        api.run_config(no_such_option=1)
    with pytest.raises(AttackError, match=r"^No attack option is called 'max_record'; the names are: "):
        api.attack("nowhere", max_record=10)


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_estimators_on_gaussian_scores_from_elsewhere_bracket_the_true_epsilon(mu: float) -> None:
    """Scores of a mu-GDP mechanism's worst case (two unit Gaussians mu apart): the 95% lower bounds sit below the
    true epsilon and the estimate's interval holds it; with no separation nothing is found."""
    rng = np.random.default_rng(int(mu * 10))
    included, excluded = rng.normal(mu, 1.0, 2000), rng.normal(0.0, 1.0, 2000)
    truth = gdp_epsilon_closed_form(mu, 1e-5)
    assert api.epsilon_one_run(included, excluded, delta=1e-5).epsilon < truth
    assert api.epsilon_from_gdp(included, excluded, delta=1e-5).epsilon < truth
    low, high = api.gaussian_estimate(included, excluded, delta=1e-5, seed=0).ci95
    assert low <= truth <= high
    same = rng.normal(0.0, 1.0, 2000)
    assert api.epsilon_from_gdp(same, excluded, delta=1e-5).epsilon == pytest.approx(0.0, abs=0.3)
    assert (
        abs(api.auc_score(np.r_[np.ones(2000), np.zeros(2000)], np.r_[included, excluded]) - norm.cdf(mu / 2**0.5))
        < 0.02
    )


def test_importing_fedaudit_or_its_api_does_not_import_torch() -> None:
    script = (
        "import sys, fedaudit, fedaudit.api\n"
        "assert callable(fedaudit.train) and fedaudit.train is fedaudit.api.train\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_importing_fedaudit_before_torch_asks_torch_for_huge_pages_unless_told_otherwise() -> None:
    """fedaudit/__init__ sets THP_MEM_ALLOC_ENABLE=1 only where torch is not imported yet (torch reads it once) and
    the environment does not say otherwise."""
    import os
    import subprocess
    import sys

    def seen(code: str, **env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    show = "print(__import__('os').environ.get('THP_MEM_ALLOC_ENABLE', 'unset'))"
    assert seen(f"import fedaudit, torch; {show}") == "1"
    assert seen(f"import fedaudit, torch; {show}", THP_MEM_ALLOC_ENABLE="0") == "0"
    assert seen(f"import torch, fedaudit; {show}") == "unset"

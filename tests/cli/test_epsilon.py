"""``fedaudit epsilon`` and ``fedaudit datasets``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    assert_user_error,
    epsilon_cli,
)

from fedaudit.privacy.accounting import calibrate_noise_multiplier, epsilon_per_round

BATCH = 32  # FAST_ARGS' --batch-size


# ---------------------------------------------------------------------------- fedaudit epsilon


def _table(stdout: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^\s*\d+\s+(\S+)\s*$", stdout, flags=re.M)]


@pytest.mark.parametrize(
    "sigma, q, t, m, delta, accountant",
    [
        (1.0, 0.0256, 200, 15, 1e-5, "rdp"),
        (0.8, 0.05, 20, 6, 1e-6, "rdp"),
        (1.2, 0.1, 10, 4, 1e-5, "prv"),
    ],
)
def test_epsilon_command_prints_the_accountants_values(cli, sigma, q, t, m, delta, accountant):
    result = cli(
        "epsilon",
        "--noise-multiplier",
        sigma,
        "--sample-rate",
        q,
        "--steps",
        t,
        "--rounds",
        m,
        "--delta",
        delta,
        "--accountant",
        accountant,
    )
    assert result.exit_code == 0, result.output
    expected = epsilon_per_round(
        noise_multiplier=sigma,
        sample_rate=q,
        queries_per_round=t,
        rounds=m,
        delta=delta,
        accountant=accountant,
    )
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == f"epsilon={float(lines[-1].split('=')[1]):.6g}"
    assert float(lines[-1].split("=")[1]) == pytest.approx(expected[-1], rel=1e-5)
    assert _table(result.stdout) == pytest.approx(expected, rel=1e-5)
    assert f"accountant={accountant}" in lines[0]


def test_epsilon_command_defaults(cli):
    eps = epsilon_cli(cli, "--noise-multiplier", "1", "--sample-rate", "0.0256", "--steps", "200", "--rounds", "15")
    expected = epsilon_per_round(
        noise_multiplier=1.0,
        sample_rate=0.0256,
        queries_per_round=200,
        rounds=15,
        delta=1e-5,
        accountant="rdp",
    )[-1]
    assert eps == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "target, accountant, q, t, m",
    [(4.0, "rdp", 0.05, 20, 5), (2.5, "rdp", 0.05, 20, 5), (2.0, "prv", 0.2, 2, 2)],
)
def test_epsilon_command_with_target_prints_the_noise_multiplier(cli, target, accountant, q, t, m):
    common = dict(sample_rate=q, queries_per_round=t, rounds=m, delta=1e-5, accountant=accountant)
    result = cli(
        "epsilon",
        "--target-epsilon",
        target,
        "--sample-rate",
        q,
        "--steps",
        t,
        "--rounds",
        m,
        "--accountant",
        accountant,
    )
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
    "client-fraction": [
        *"--noise-multiplier 1 --sample-rate 0.1 --steps 10 --rounds 2 --client-fraction 0.5".split(),
    ],
    "both": [
        *"--noise-multiplier 1 --target-epsilon 3 --sample-rate 0.1 --steps 10 --rounds 2".split(),
    ],
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
    table, _, notes = result.stdout.partition("\n\n")
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert {"digits", "fashion-mnist", "mnist", "cifar10"} <= set(rows)
    assert "scikit-learn (bundled)" in rows["digits"] and "1437" in rows["digits"]
    assert str(raw) in rows["fashion-mnist"]
    assert re.search(r"\b12\s+7\b", rows["fashion-mnist"])  # sizes read from the IDX headers
    assert str(tmp_path) not in rows["mnist"] and "not found" in rows["mnist"]
    assert "--data-dir" in next(line for line in notes.splitlines() if line.startswith("mnist:"))  # how to get it
    assert max(len(line) for line in table.splitlines()) <= 60 + len(str(raw)) and "<NA>" not in result.stdout

    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("datasets", "--data-dir", empty)
    assert result.exit_code == 0, result.output
    fashion = next(line for line in result.stdout.splitlines() if line.startswith("fashion-mnist"))
    assert str(empty) not in fashion and "<NA>" not in fashion
    usual = cli("datasets").stdout  # where it is found without --data-dir, if anywhere
    found = next(line for line in usual.splitlines() if line.startswith("fashion-mnist")).split()[-1]
    hint = next(line for line in result.stdout.splitlines() if line.startswith("fashion-mnist:"))
    if found != "found":  # installed here: the hint says --data-dir replaced the usual places, not "install it"
        assert f"Not in {empty}, the one place --data-dir searches; found at {found} without it." in hint
    else:
        assert "Install" in hint
    result = cli("datasets", "--data-dir", tmp_path / "nowhere")
    assert result.exit_code == 2 and "does not exist" in result.output

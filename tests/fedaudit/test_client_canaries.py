"""Canary clients inside a client-level DP run (--canary-clients): their log against an independent recomputation
from the run's own files, the audit's epsilon against the run's ledger, a planted fault caught and correct runs not
flagged, and a resumed run that goes on with the same log."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import FAST_ARGS, invoke
from safetensors.numpy import load_file

from fedaudit.instruments.canary_log import read_log
from fedaudit.models import initial_params
from fedaudit.preparation import prepare
from fedaudit.rundir import RunDirectory
from fedaudit.seeding import Stream, numpy_rng

CLIENT_LEVEL = ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--num-clients", "10", "--partition", "iid")


def _train(run, *extra: str) -> None:
    result = invoke("train", *FAST_ARGS, *CLIENT_LEVEL, *extra, "--out", run)
    assert result.exit_code == 0, result.output


def test_the_log_holds_the_cosines_an_independent_loop_computes(tmp_path) -> None:
    """The final model minus the initial one, each canary's direction drawn again from (seed, CANARY, i) with numpy:
    the log's final cosines to 1e-9; the inclusion bits are half of the canaries, and each round's population the
    real clients plus the included canaries."""
    run = tmp_path / "run"
    _train(run, "--noise-multiplier", "1", "--rounds", "2", "--canary-clients", "30")
    log = read_log(run / "canary-clients.npz")
    setup = prepare(RunDirectory(run).read_run_config(), device="cpu")
    initial = initial_params(setup.spec, setup.config.seed)
    final = load_file(str(run / "model.safetensors"))
    change = np.concatenate(
        [final[name].astype(np.float64).ravel() - p.double().numpy().ravel() for name, p in initial.items()]
    )
    for i in range(30):
        direction = numpy_rng(setup.config.seed, Stream.CANARY, i).standard_normal(change.size)
        expected = direction @ change / (np.linalg.norm(direction) * np.linalg.norm(change))
        assert log.final_cosines[i] == pytest.approx(expected, abs=1e-9)
    assert 5 <= log.included.sum() <= 25 and list(log.population) == [10 + int(log.included.sum())] * 2
    assert list(log.sample_rate) == [1.0, 1.0] and list(log.sampled) == [0, 0]  # the count is the server's sample


def test_the_audit_is_judged_against_the_runs_own_ledger(tmp_path) -> None:
    run = tmp_path / "run"
    _train(run, "--client-fraction", "0.5", "--target-epsilon", "8", "--rounds", "3", "--canary-clients", "40")
    assert invoke("attack", run, "--method", "canary").exit_code == 0
    ledger = json.loads((run / "privacy.json").read_text())["epsilon_per_round"][-1]
    for view in ("all-iterates", "final-model"):
        metrics = json.loads((run / "attacks" / f"canary-clients-{view}" / "metrics.json").read_text())
        assert metrics["accountant_epsilon"] == pytest.approx(ledger, rel=1e-9)
        assert metrics["canary_audit"]["canaries"] == 40 and metrics["method"] == "canary"


def _bound(run) -> tuple[float, float]:
    assert invoke("attack", run, "--method", "canary").exit_code == 0
    views = [
        json.loads((run / "attacks" / f"canary-clients-{v}" / "metrics.json").read_text())
        for v in ("all-iterates", "final-model")
    ]
    return max(v["epsilon_lower_bound"] for v in views), views[0]["accountant_epsilon"]


def test_a_server_that_adds_a_tenth_of_the_noise_is_caught_and_correct_runs_are_not(
    tmp_path, monkeypatch, fixed_secrets
) -> None:
    """The fault: the server draws its noise at sigma / 10 while the ledger charges sigma. The canary clients prove
    more than the accountant's epsilon; the same runs without the fault, on three seeds, never do. The server's
    secret is fixed, so these are the same runs on every machine."""
    args = ("--target-epsilon", "4", "--rounds", "5", "--canary-clients", "400")
    for seed in (0, 1, 2):
        _train(tmp_path / f"correct-{seed}", *args, "--seed", str(seed))
        bound, epsilon = _bound(tmp_path / f"correct-{seed}")
        assert bound <= epsilon, seed
    import fedaudit.algorithms.fedavg as fedavg

    honest = fedavg.client_level_mean

    def quieter(*a, noise_multiplier, **kw):
        return honest(*a, noise_multiplier=noise_multiplier / 10, **kw)

    monkeypatch.setattr(fedavg, "client_level_mean", quieter)
    _train(tmp_path / "faulty", *args)
    bound, epsilon = _bound(tmp_path / "faulty")
    assert bound > epsilon


def test_a_resumed_run_goes_on_with_the_same_canary_log(tmp_path, fixed_secrets) -> None:
    args = (
        "--noise-multiplier",
        "1",
        "--client-fraction",
        "0.5",
        "--lr-schedule",
        "constant",
        "--canary-clients",
        "20",
    )
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _train(whole, *args, "--rounds", "4")
    _train(resumed, *args, "--rounds", "2")
    result = invoke("train", "--resume", resumed, "--rounds", "4")
    assert result.exit_code == 0, result.output
    assert (resumed / "canary-clients.npz").read_bytes() == (whole / "canary-clients.npz").read_bytes()


@pytest.mark.parametrize(
    "extra",
    [("--canary-clients", "3"), ("--canary-clients", "-1")],
    ids=["too-few", "negative"],
)
def test_too_few_canary_clients_are_one_sentence(tmp_path, extra) -> None:
    result = invoke("train", *FAST_ARGS, *CLIENT_LEVEL, *extra, "--out", tmp_path / "run")
    assert result.exit_code == 2 and "--canary-clients must be 0 or an integer of at least 4" in result.output
    assert not (tmp_path / "run").exists()


def test_canary_clients_need_client_level(tmp_path) -> None:
    result = invoke("train", *FAST_ARGS, "--dp", "--canary-clients", "10", "--out", tmp_path / "run")
    assert result.exit_code == 2 and "--canary-clients audits client-level DP" in result.output
    assert not (tmp_path / "run").exists()

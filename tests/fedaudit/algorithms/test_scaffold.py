"""SCAFFOLD: control variates remove client drift exactly on a quadratic problem, keep c the mean of the c_k, cost no
privacy, and a run resumes to the same bytes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FAST_ARGS, engine_independent_digest, interrupt_in_round
from safetensors.torch import load_file
from torch import nn

from fedaudit.algorithms.base import ClientData, RoundContext
from fedaudit.algorithms.fedavg import FedAvg
from fedaudit.algorithms.scaffold import CONTROL, Scaffold
from fedaudit.config import DataConfig, FederatedConfig, RunConfig
from fedaudit.preparation import select_clients
from fedaudit.rundir import RunDirectory

D, CLIENTS, N = 3, 4, 8


def _half_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * (output - target).pow(2).sum(dim=1).mean()


class QuadraticFedAvg(FedAvg):
    loss = staticmethod(_half_squared_error)


class QuadraticScaffold(Scaffold):
    loss = staticmethod(_half_squared_error)


def _problem() -> tuple[list[ClientData], torch.Tensor]:
    """Least squares per client with very different Hessians X_k^T X_k / N, and the minimiser of their plain mean."""
    generator = torch.Generator().manual_seed(0)
    clients, hessian, linear = [], torch.zeros(D, D, dtype=torch.float64), torch.zeros(D, dtype=torch.float64)
    for k in range(CLIENTS):
        scales = torch.tensor([1.0, 0.3, 0.1], dtype=torch.float64).roll(k) * (1 + k)
        x = torch.randn(N, D, generator=generator, dtype=torch.float64) * scales
        y = x @ torch.randn(D, generator=generator, dtype=torch.float64) * 2 + 1
        clients.append(ClientData(k, x, y[:, None]))
        hessian += x.T @ x / N
        linear += x.T @ y / N
    return clients, torch.linalg.solve(hessian, linear)


def _config(client_fraction: float = 1.0) -> RunConfig:
    federated = FederatedConfig(
        algorithm="scaffold",
        rounds=400,
        local_epochs=5,
        batch_size=N,  # full batches: every local step is a gradient step on the client's whole objective
        client_lr=0.05,
        lr_schedule="constant",
        weighting="uniform",
        client_fraction=client_fraction,
    )
    return RunConfig(data=DataConfig(num_clients=CLIENTS), federated=federated).resolved()


def _train(algorithm: FedAvg, config: RunConfig, rounds: int, check=None) -> torch.Tensor:
    """The round loop of the training core, in miniature: selected clients, client states, the server state."""
    clients, _ = _problem()
    model = nn.Linear(D, 1, bias=False).double()
    params = {"weight": torch.zeros(1, D, dtype=torch.float64)}
    server_state: dict[str, torch.Tensor] = {}
    states: dict[int, dict[str, torch.Tensor]] = {}
    for m in range(rounds):
        ctx = RoundContext(m, rounds, config, torch.device("cpu"), server_state=server_state)
        selected = select_clients(0, m, CLIENTS, config.federated.client_fraction)
        messages = [
            algorithm.client_update(model, params, clients[k], ctx, torch.Generator().manual_seed(m), states.get(k))
            for k in selected
        ]
        states.update({msg.client_id: msg.state for msg in messages if msg.state})
        result = algorithm.server_update(model, params, messages, ctx, torch.Generator())
        params, server_state = result.params, result.state
        if check is not None:
            check(server_state, states, messages)
    return params["weight"][0]


def test_control_variates_remove_client_drift_exactly_on_a_quadratic_problem() -> None:
    """Five local steps on clients with different Hessians: FedAvg settles away from the minimiser of the mean
    objective (client drift), SCAFFOLD converges to it to machine precision."""
    config = _config()
    _, optimum = _problem()
    scaffold = _train(QuadraticScaffold(config), config, 400)
    fedavg = _train(QuadraticFedAvg(config), config, 400)
    assert torch.linalg.norm(scaffold - optimum) < 1e-10
    assert torch.linalg.norm(fedavg - optimum) > 1e-2  # the drift SCAFFOLD removes


def test_the_server_control_variate_stays_the_mean_of_all_clients_under_partial_participation() -> None:
    config = _config(client_fraction=0.5)
    seen: list[float] = []

    def check(server_state, states, messages) -> None:
        assert {msg.client_id for msg in messages} <= set(states)
        for msg in messages:  # what crossed the wire: the model delta and the control delta
            assert set(msg.payload) == {"weight", f"{CONTROL}weight"}
        everyone = [states.get(k, {"weight": torch.zeros(1, D, dtype=torch.float64)})["weight"] for k in range(CLIENTS)]
        mean = torch.stack(everyone).mean(dim=0)
        torch.testing.assert_close(server_state["weight"], mean, rtol=0, atol=1e-12)
        seen.append(float(server_state["weight"].norm()))

    _train(QuadraticScaffold(config), config, 30, check)
    assert min(seen) > 0  # the control variates did move


def test_option_two_control_variate_is_the_mean_applied_gradient() -> None:
    """c_k+ = c_k - c + (x - y_k) / (K eta): with zero control variates, the mean gradient along the local path."""
    config = _config()
    clients, _ = _problem()
    data = clients[1]
    model = nn.Linear(D, 1, bias=False).double()
    x = {"weight": torch.full((1, D), 0.3, dtype=torch.float64)}
    ctx = RoundContext(0, 1, config, torch.device("cpu"))
    message = QuadraticScaffold(config).client_update(model, x, data, ctx, torch.Generator().manual_seed(0))
    w, gradients = x["weight"].clone(), []
    for _ in range(5):
        gradient = (data.x @ w.T - data.y).T @ data.x / N
        gradients.append(gradient)
        w = w - 0.05 * gradient
    torch.testing.assert_close(message.state["weight"], torch.stack(gradients).mean(dim=0))
    torch.testing.assert_close(message.payload["weight"], w - x["weight"])


SCAFFOLD_ARGS = (*FAST_ARGS, "--algorithm", "scaffold", "--rounds", "3", "--client-fraction", "0.6")


def test_a_scaffold_run_keeps_its_state_and_resumes_to_the_same_bytes(tmp_path, cli, monkeypatch):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert cli("train", *SCAFFOLD_ARGS, "--save-transmitted", "--out", full).exit_code == 0
    server = load_file(full / "checkpoints" / "round-0003-server.safetensors")
    clients = RunDirectory(full).states.at(3)  # every client that took part keeps its c_k
    took_part = {
        c["client"]
        for r in (1, 2, 3)
        for c in json.loads((full / "checkpoints" / f"round-{r:04d}.json").read_text())["clients"]
    }
    assert set(clients) == took_part and all(set(state) == set(server) for state in clients.values())
    latest = load_file(full / "checkpoints" / "round-0003-clients.safetensors")  # a round's file: what it changed
    assert {int(name.split("/")[0].removeprefix("client")) for name in latest} == {
        c["client"] for c in json.loads((full / "checkpoints" / "round-0003.json").read_text())["clients"]
    }
    sent = load_file(next((full / "transmitted" / "round-0001").glob("client-*.safetensors")))
    assert {name for name in sent if name.startswith(CONTROL)} == {f"{CONTROL}{name}" for name in server}
    interrupt_in_round(monkeypatch, 2)
    assert cli("train", *SCAFFOLD_ARGS, "--save-transmitted", "--out", resumed).exit_code == 1
    monkeypatch.undo()
    assert cli("train", "--resume", resumed, "--no-progress").exit_code == 0
    assert engine_independent_digest(resumed) == engine_independent_digest(full)


@pytest.mark.parametrize("dp", [False, True])
def test_dp_scaffold_spends_exactly_what_dp_fedavg_spends(tmp_path, cli, dp):
    """The correction is added after the noise and the control update is post-processing: the same ledger."""
    extra = ("--dp",) if dp else ()
    for algorithm in ("scaffold", "fedavg"):
        result = cli(
            "train", *FAST_ARGS, "--rounds", "2", *extra, "--algorithm", algorithm, "--out", tmp_path / algorithm
        )
        assert result.exit_code == 0, result.output
    runs = [tmp_path / name for name in ("scaffold", "fedavg")]
    if dp:
        ledgers = [json.loads((run / "privacy.json").read_text()) for run in runs]
        assert ledgers[0] == ledgers[1]
    models = [load_file(run / "model.safetensors") for run in runs]
    assert any(not torch.equal(models[0][name], models[1][name]) for name in models[0])  # the correction acted


def test_client_states_live_in_the_rounds_that_changed_them_and_survive_keep_checkpoints(tmp_path, cli, monkeypatch):
    """A round's clients file holds only the states it changed; with --keep-checkpoints 1 the states of clients whose
    file is removed are carried into the newest one, so every client's c_k after round 4 is what a run that keeps
    every checkpoint has, and a run interrupted in round 3 resumes to the same model."""
    args = (*FAST_ARGS, "--algorithm", "scaffold", "--rounds", "4", "--client-fraction", "0.4")
    every, last, resumed = tmp_path / "every", tmp_path / "last", tmp_path / "resumed"
    assert cli("train", *args, "--out", every).exit_code == 0
    assert cli("train", *args, "--keep-checkpoints", "1", "--out", last).exit_code == 0
    interrupt_in_round(monkeypatch, 3)
    assert cli("train", *args, "--keep-checkpoints", "1", "--out", resumed).exit_code == 1
    monkeypatch.undo()
    assert cli("train", "--resume", resumed, "--no-progress").exit_code == 0
    took_part = [set(select_clients(0, m, 5, 0.4)) for m in range(4)]
    for r in range(1, 5):
        names = load_file(every / "checkpoints" / f"round-{r:04d}-clients.safetensors")
        assert {int(n.split("/")[0].removeprefix("client")) for n in names} == took_part[r - 1]
    assert [p.name for p in (last / "checkpoints").glob("*-clients.safetensors")] == ["round-0004-clients.safetensors"]
    expected = RunDirectory(every).states.at(4)
    assert set(expected) == set().union(*took_part) and len(expected) > len(took_part[3])
    for run in (last, resumed):
        states = RunDirectory(run).states.at(4)
        assert set(states) == set(expected)
        for k, state in expected.items():
            assert all(torch.equal(states[k][name], value) for name, value in state.items())
        assert (run / "model.safetensors").read_bytes() == (every / "model.safetensors").read_bytes()


_KILLED_IN_COMMIT = """
import os, sys
import fedaudit.rundir.files as run_files
real, seen = run_files.atomic_write_bytes, {"model": 0}
def write(path, data, *args, **kwargs):
    if path.name == "model.safetensors":
        seen["model"] += 1
        if seen["model"] == int(sys.argv[1]):
            os._exit(137)  # killed in the middle of committing that round, its other files already written
    return real(path, data, *args, **kwargs)
run_files.atomic_write_bytes = write
from fedaudit.cli import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("keep", ["1", "2", "3"])
def test_every_kept_round_has_every_clients_state_even_after_a_kill_in_a_commit(tmp_path, cli, keep):
    """--keep-checkpoints K: after every round, each kept round's client states (what a resume or the reconstruction
    attack reads) equal those of a run that keeps every checkpoint; a run killed while committing round 6 resumes to
    the same states and model."""
    import subprocess
    import sys

    args = (*FAST_ARGS, "--algorithm", "scaffold", "--rounds", "7", "--num-clients", "8", "--client-fraction", "0.25")
    every, kept, killed = tmp_path / "every", tmp_path / "kept", tmp_path / "killed"
    assert cli("train", *args, "--out", every).exit_code == 0
    assert cli("train", *args, "--keep-checkpoints", keep, "--out", kept).exit_code == 0
    command = [sys.executable, "-c", _KILLED_IN_COMMIT, "6", "train", *args, "--keep-checkpoints", keep]
    assert subprocess.run([*command, "--out", str(killed)], capture_output=True).returncode == 137
    assert cli("train", "--resume", killed, "--no-progress").exit_code == 0
    reference = RunDirectory(every)
    for run in (kept, killed):
        assert (run / "model.safetensors").read_bytes() == (every / "model.safetensors").read_bytes()
        for m in range(8 - int(keep), 8):  # the kept rounds
            expected, states = reference.states.at(m), RunDirectory(run).states.at(m)
            assert set(states) == set(expected), (run.name, m)
            for k, state in expected.items():
                assert all(torch.equal(states[k][name], value) for name, value in state.items())

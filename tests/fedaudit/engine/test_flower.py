"""The Flower engine: clients on Flower's simulation runtime (Ray) give the same run as the local engine, byte for
byte.

The test of training and resuming starts Ray on this machine for each of its simulations, as a run without
--ray-address does; the other simulations run on a Ray cluster (a head with one CPU) that the module starts once:
starting Ray is about ten seconds of a simulation that does it.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pandas as pd
import pytest
from helpers import (
    FAST_ARGS,
    assert_user_error,
    digit_halves,
    engine_independent_digest,
    interrupt_in_round,
    update_distances,
)

pytest.importorskip("flwr.simulation", reason="the flower extra is not installed")  # `make test` installs it

# FedLAP-DP with what a client keeps between rounds (--init previous), a sampled subset of clients per round,
# and what crossed the wire saved: every path of the message seam is exercised.
ARGS = (
    *FAST_ARGS,
    *"--dp --algorithm fedlap --ipc 2 --trajectories 1 --max-loops 2 --real-batches 2 --image-steps 2".split(),
    *"--init previous --client-fraction 0.6 --save-transmitted".split(),
)
READ_JSON = json.loads


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray head started here stands for a cluster (one CPU); stopped, by pid, after the module's last test."""
    from federation import RayHead

    head = RayHead(tmp_path_factory.mktemp("ray"), cpus=1)
    try:
        yield head
    finally:
        head.close()


def test_flower_trains_and_resumes_the_same_run_as_the_local_engine(tmp_path, cli, monkeypatch, fixed_secrets):
    local, flower = tmp_path / "local", tmp_path / "flower"
    assert cli("train", *ARGS, "--rounds", "3", "--out", local).exit_code == 0
    interrupt_in_round(monkeypatch, 3)  # Ctrl-C while round 3 is evaluated: the simulation must shut down cleanly
    result = cli("train", *ARGS, "--rounds", "3", "--engine", "flower", "--out", flower)
    assert result.exit_code == 1, result.output
    manifest = READ_JSON((flower / "manifest.json").read_text())
    assert (manifest["engine"], manifest["status"], manifest["rounds_done"]) == ("flower", "interrupted", 2)
    assert READ_JSON((flower / "config.json").read_text())["engine"] == "flower"

    monkeypatch.undo()
    result = cli("train", "--resume", flower, "--no-progress")  # a new simulation for round 3
    assert result.exit_code == 0, result.output
    assert engine_independent_digest(flower) == engine_independent_digest(local)
    assert (flower / "model.safetensors").read_bytes() == (local / "model.safetensors").read_bytes()
    assert READ_JSON((flower / "privacy.json").read_text()) == READ_JSON((local / "privacy.json").read_text())
    metrics = [pd.read_csv(run / "metrics.csv").drop(columns="wall_seconds") for run in (flower, local)]
    pd.testing.assert_frame_equal(*metrics)
    assert len(list((flower / "transmitted").glob("round-*/client-*.safetensors"))) == 3 * 3  # 3 of 5 clients a round


@pytest.mark.parametrize(
    "extra",
    [
        # the generation round takes every client whatever --client-fraction says, and the server deals each one
        # its share, which then travels with the client's kept state; SCAFFOLD's control variates ride along
        (
            "--algorithm",
            "fedssyn",
            "--inner-algorithm",
            "scaffold",
            "--dp",
            "--client-fraction",
            "0.6",
            "--generator-epochs",
            "1",
            "--synthetic-per-client",
            "20",
        ),
        # what the server keeps to itself (FedGM's received stages) never goes to the clients
        (
            "--algorithm",
            "fedgm",
            "--label-epsilon",
            "2",
            "--distill-iterations",
            "2",
            "--distill-steps",
            "2",
            "--server-steps",
            "5",
        ),
        ("--algorithm", "feddm", "--dm-iterations", "3", "--server-epochs", "2"),
        # client-level DP: the server samples, clips and noises (its draws from the noise seed, as are the clients')
        (
            "--algorithm",
            "fedprox",
            "--dp",
            "--dp-level",
            "client",
            "--max-update-norm",
            "0.5",
            "--noise-seed",
            "5",
            "--client-fraction",
            "0.5",
        ),  # fmt: skip
        # the noise in shares: each client adds its share for the round's m clients, which the task tells it
        (
            *("--dp", "--dp-level", "client", "--max-update-norm", "0.5", "--noise-at", "clients"),
            *("--noise-seed", "5", "--num-clients", "12", "--client-fraction", "0.9"),
        ),
    ],
    ids=["fedssyn", "fedgm", "feddm", "fedprox-client-level", "fedavg-noise-in-shares"],
)
def test_the_other_systems_train_the_same_run_on_flower(tmp_path, cli, extra, fixed_secrets, ray_cluster):
    args = (*FAST_ARGS, "--rounds", "2", "--save-transmitted", *extra)
    local, flower = tmp_path / "local", tmp_path / "flower"
    assert cli("train", *args, "--out", local).exit_code == 0
    result = cli("train", *args, "--engine", "flower", "--ray-address", ray_cluster.address, "--out", flower)
    assert result.exit_code == 0, result.output
    assert engine_independent_digest(flower) == engine_independent_digest(local)
    if (local / "server-metrics.csv").exists():  # the server's records but for its clock
        frames = [pd.read_csv(run / "server-metrics.csv").drop(columns="wall_seconds") for run in (flower, local)]
        pd.testing.assert_frame_equal(*frames)


def test_simulated_clients_draw_their_noise_from_the_run_directorys_secrets(tmp_path, cli, ray_cluster):
    """The same seed and settings on other records: the simulation's clients send updates as far from the local
    engine's as independent noise makes them, from secrets kept in the run directory, readable by its owner only."""
    args = (*FAST_ARGS, "--dp", "--rounds", "1", "--num-clients", "2", "--partition", "iid", "--seed", "7")
    first, second = digit_halves(tmp_path)
    local, flower = tmp_path / "local", tmp_path / "flower"
    assert cli("train", *args, "--dataset", f"npz:{first}", "--save-transmitted", "--out", local).exit_code == 0
    result = cli(
        "train", *args, "--dataset", f"npz:{second}", "--save-transmitted", "--engine", "flower",
        "--ray-address", ray_cluster.address, "--out", flower,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((flower / "client-secrets.json").stat().st_mode) == 0o600
    assert all(d >= 1.2 for d in update_distances(local, flower)), update_distances(local, flower)


def test_without_flower_installed_the_engine_is_a_user_error(tmp_path, cli, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flwr.simulation", None)  # as if Flower were not installed: import fails
    out = tmp_path / "run"
    assert_user_error(cli("train", *FAST_ARGS, "--engine", "flower", "--out", out), mentions="Flower")
    assert not out.exists()


def test_the_simulation_runs_on_an_existing_ray_cluster(tmp_path, cli, fixed_secrets, ray_cluster):
    """A Ray head started here stands for a cluster: the clients run on its workers, with the resources asked for
    (half a CPU each: two at once on the head's one). DP-SCAFFOLD: the server's control variate goes to the clients
    with the model, and theirs come back."""
    head = ray_cluster
    args = (*FAST_ARGS, "--rounds", "2", "--dp", "--algorithm", "scaffold", "--client-fraction", "0.6")
    local, cluster = tmp_path / "local", tmp_path / "cluster"
    assert cli("train", *args, "--out", local).exit_code == 0
    result = cli(
        "train", *args, "--engine", "flower", "--ray-address", head.address, "--client-cpus", "0.5", "--out", cluster
    )
    assert result.exit_code == 0, result.output + head.log.read_text(errors="replace")[-2000:]
    assert engine_independent_digest(cluster) == engine_independent_digest(local)
    flower = json.loads((cluster / "config.json").read_text())["flower"]
    assert (flower["ray_address"], flower["client_cpus"]) == (head.address, 0.5)


@pytest.mark.parametrize(
    ("extra", "mentions"),
    [
        (("--ray-address", "127.0.0.1:6379"), "--engine flower"),
        (("--engine", "flower", "--client-gpus", "2"), "--client-gpus"),
        (("--engine", "flower", "--client-cpus", "0"), "--client-cpus"),
        (("--engine", "flower", "--ray-address", "nohost"), "HOST:PORT"),
    ],
)
def test_bad_ray_options_are_one_sentence(tmp_path, cli, extra, mentions):
    out = tmp_path / "run"
    assert_user_error(cli("train", *FAST_ARGS, *extra, "--out", out), mentions=mentions)
    assert not out.exists()


def test_every_simulation_this_project_starts_asks_for_a_ray_instance_of_its_own():
    """Ray joins the cluster that `ray start` left on the machine (this module's head, while it runs) when a
    simulation names no address, and then refuses its num_cpus: the engine, the tests' and benchmarks' apps and the
    documented example each say "local" (or the --ray-address the user gave)."""
    root = Path(__file__).resolve().parents[3]
    callers = [
        path
        for pattern in ("fedaudit/**/*.py", "tests/support/*.py", "benchmarks/*.py", "docs/*.md")
        for path in root.glob(pattern)
        if "run_simulation(" in path.read_text()
    ]
    assert {path.name for path in callers} >= {
        "simulation.py",
        "flower_digits.py",
        "flower_canaries.py",
        "flower-apps.md",
    }
    for path in callers:
        text = path.read_text()
        assert '"address": "local"' in text or 'address="local"' in text, f"{path}: a simulation without an address"

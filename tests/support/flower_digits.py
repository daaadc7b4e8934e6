"""A Flower app written with Flower's API only, in the style of Flower's PyTorch quickstart (a ClientApp that trains a
small MLP on its partition of scikit-learn's digits, a ServerApp that runs FedAvg under Flower's
DifferentialPrivacyServerSideFixedClipping), with fedaudit's canary clients around the strategy.

The ServerApp runs several trainings ("scenarios") one after the other on the same simulated federation, so that the
tests pay for Flower's simulation runtime (Ray) once. A scenario may plant a fault in Flower's own DP code for its
duration (``planted``): the noise multiplier replaced by 0, clipping switched off, or the noise added in the first
round only.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.serverapp.strategy import dp_fixed_clipping as flower_dp
from sklearn.datasets import load_digits
from torch import nn

from fedaudit.flower import CanaryClients, canary_client_count

NUM_NODES = 10
RECORDS_PER_NODE = 179  # equal partitions: Flower's DP noise assumes equal weights
FAULTS = ("noise-zero", "no-clipping", "noise-once")


class Net(nn.Module):
    """64 -> 32 -> 10 (2,410 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_partition(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One node's records: an equal share of digits after a fixed shuffle."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))[: num_partitions * RECORDS_PER_NODE]
    mine = order[partition_id::num_partitions]
    return torch.tensor(x[mine] / 16.0, dtype=torch.float32), torch.tensor(y[mine])


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One local epoch of SGD from the global model; reply with the new model and the number of examples."""
    torch.set_num_threads(1)
    partition, partitions = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_partition(partition, partitions)
    generator = torch.Generator().manual_seed(int(msg.content["config"]["server-round"]) * 1000 + partition)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in torch.randperm(len(y), generator=generator).split(32):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    metrics = MetricRecord({"train_loss": float(np.mean(losses)), "num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@dataclass(frozen=True)
class Scenario:
    """One training of the ServerApp: its seed, sampling, rounds, DP settings, canary sets and planted fault."""

    name: str
    seed: int
    fraction: float
    rounds: int
    noise_multiplier: float = 1.0
    clipping_norm: float = 0.1
    canaries: tuple[tuple[int, int], ...] = ((500, 0),)  # (count, seed) of each nested CanaryClients
    fault: str | None = None
    keep_models: bool = False
    logs: dict[int, str] = field(default_factory=dict, compare=False)

    def log(self, out: Path, canary_seed: int) -> Path:
        return out / f"{self.name}-canaries{canary_seed}.npz"


@contextmanager
def planted(fault: str | None) -> Iterator[None]:
    """Plant ``fault`` in Flower's DifferentialPrivacyServerSideFixedClipping code path while the block runs."""
    if fault is None:
        yield
        return
    if fault == "noise-zero":  # the noise's standard deviation computed as 0, whatever the noise multiplier
        patch = mock.patch.object(flower_dp, "compute_stdv", lambda *args, **kwargs: 0.0)
    elif fault == "no-clipping":  # each reply's update kept as it came
        patch = mock.patch.object(flower_dp, "compute_clip_model_update", lambda *args, **kwargs: None)
    elif fault == "noise-once":  # noise added to the first aggregate of the run, never again
        original = flower_dp.DifferentialPrivacyFixedClippingBase._add_noise_to_aggregated_arrays
        calls = []

        def once(self: object, arrays: ArrayRecord) -> ArrayRecord:
            calls.append(1)
            return original(self, arrays) if len(calls) == 1 else arrays

        patch = mock.patch.object(
            flower_dp.DifferentialPrivacyFixedClippingBase, "_add_noise_to_aggregated_arrays", once
        )
    else:
        raise ValueError(f"unknown fault {fault!r}")
    with patch:
        yield


def run_scenario(grid: Grid, scenario: Scenario, out: Path) -> None:
    """Train ``scenario`` on the grid: seeds for Flower's sampler (random) and noise (numpy), the DP strategy with
    num_sampled_clients counting the canary clients, canary sets nested around it."""
    random.seed(scenario.seed)
    np.random.seed(scenario.seed)
    torch.manual_seed(scenario.seed)
    while len(list(grid.get_node_ids())) < NUM_NODES:
        time.sleep(0.1)
    population = NUM_NODES + sum(canary_client_count(count, seed) for count, seed in scenario.canaries)
    sampled = max(int(population * scenario.fraction), 2)
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=scenario.fraction, fraction_evaluate=0.0, min_available_nodes=NUM_NODES),
        noise_multiplier=scenario.noise_multiplier,
        clipping_norm=scenario.clipping_norm,
        num_sampled_clients=sampled,
    )
    for count, seed in scenario.canaries:
        strategy = CanaryClients(strategy, canaries=count, seed=seed, log=scenario.log(out, seed))
    models: list[dict[str, np.ndarray]] = []

    def keep(_: int, arrays: ArrayRecord) -> None:
        if scenario.keep_models:
            models.append(arrays.to_numpy_ndarrays())

    with planted(scenario.fault):
        strategy.start(
            grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=scenario.rounds, evaluate_fn=keep
        )
    if scenario.keep_models:
        np.savez(out / f"{scenario.name}-models.npz", *[np.concatenate([a.ravel() for a in m]) for m in models])


def server_app(scenarios: list[Scenario], out: Path) -> ServerApp:
    """A ServerApp that trains every scenario in turn, writing its logs into ``out``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for scenario in scenarios:
            run_scenario(grid, scenario, out)

    return app


def simulate(scenarios: list[Scenario], out: Path) -> None:
    """Run the ServerApp on Flower's simulation runtime with NUM_NODES SuperNodes and one CPU for Ray."""
    import logging

    from flwr.simulation import run_simulation

    out.mkdir(parents=True, exist_ok=True)
    run_simulation(
        server_app=server_app(scenarios, out),
        client_app=client_app,
        num_supernodes=NUM_NODES,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {
                "address": "local",  # its own Ray instance, even while another test's `ray start` cluster runs
                "num_cpus": 1,
                "include_dashboard": False,
                "logging_level": logging.ERROR,
                "log_to_driver": False,
            },
        },
    )

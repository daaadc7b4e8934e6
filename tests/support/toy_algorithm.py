"""The tests' toy algorithm: FedAvg under another name with defaults of its own, what a new algorithm module and its
one registry entry look like (tests/test_extending.py runs it through a study, the registry's tests through the
configuration)."""

from __future__ import annotations

from fedaudit.algorithms.fedavg import FedAvg
from fedaudit.registry import AlgorithmEntry


class FedAvgTwice(FedAvg):
    """FedAvg under another name."""

    name = "fedavg-twice"


ENTRY = AlgorithmEntry(
    name="fedavg-twice",
    label="FedAvgTwice",
    dp_label="DP-FedAvgTwice",
    summary="FedAvg under another name",
    implementation=f"{__name__}:FedAvgTwice",
    client_lr=0.3,
    max_grad_norm=0.7,
    colour="#123456",
    local_sgd=True,
)

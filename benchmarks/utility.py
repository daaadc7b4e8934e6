"""Accuracy vs epsilon: FedLAP-DP, DP-FedAvg and DP-FedProx on Fashion-MNIST at equal data access.

The paper's setting (5 clients x 2 classes, sigma = 1, B = 256, the authors' DP
configurations) at a reduced ConvNet width so that a few rounds fit in about an
hour on a 2-core CPU. The baselines run as many local steps (DP queries) per
round as FedLAP-DP's worst case T = R_i * L * R_b, so every algorithm spends the
same epsilon per round. Prints one table (round, epsilon, accuracy per
algorithm) next to the paper's Table 2 figures for Fashion-MNIST (width 128,
full training; epsilon 2.79 is their first round).

    python benchmarks/utility.py [--rounds 3] [--width 16] [--out runs/utility] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from fedaudit.config import DataConfig, FederatedConfig, ModelConfig, PrivacyConfig, RunConfig
from fedaudit.setup import prepare
from fedaudit.training import train

PAPER_TABLE_2 = pd.DataFrame(
    {
        "epsilon": [2.79, 10.18],
        "FedLAP-DP": ["59.85 +- 1.5", "73.00 +- 0.7"],
        "DP-FedAvg": ["50.11 +- 4.2", "72.78 +- 1.3"],
        "DP-FedProx": ["54.57 +- 2.9", "71.67 +- 2.2"],
    }
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/utility")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = RunConfig(
        seed=args.seed,
        device="cpu",
        data=DataConfig(dataset="fashion-mnist", partition="classes:2", num_clients=5),
        model=ModelConfig(width=args.width),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0),
    )
    lap = base.with_overrides({"federated": FederatedConfig(algorithm="fedlap", rounds=args.rounds)})
    queries = max(prepare(lap).queries.values())
    configs = {
        "FedLAP-DP": lap,
        "DP-FedAvg": base.with_overrides(
            {"federated": FederatedConfig(algorithm="fedavg", rounds=args.rounds, local_steps=queries)}
        ),
        "DP-FedProx": base.with_overrides(
            {"federated": FederatedConfig(algorithm="fedprox", rounds=args.rounds, local_steps=queries)}
        ),
    }
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}; Fashion-MNIST, 5 clients x 2 classes, "
        f"ConvNet width {args.width}, sigma 1, B 256, T = {queries} DP queries per client per round, seed {args.seed}"
    )
    columns = {}
    for name, config in configs.items():
        started = time.perf_counter()
        result = train(
            config,
            Path(args.out) / name,
            overwrite=True,
            progress=False,
            echo=lambda line, n=name: print(f"  {n}: {line}"),
        )
        metrics = pd.read_csv(result.run_dir / "metrics.csv")
        columns[name] = metrics.set_index("round")[["epsilon", "test_accuracy"]]
        print(f"  {name}: {time.perf_counter() - started:.0f} s")
    table = pd.DataFrame({"epsilon": columns["FedLAP-DP"]["epsilon"].round(2)})
    for name, frame in columns.items():
        table[f"{name} acc %"] = (100 * frame["test_accuracy"]).round(2)
    print("\nThis run (accuracy after each round; epsilon is the same for all three at equal data access):")
    print(table.to_string())
    print("\nPaper, Table 2 (Fashion-MNIST, mean +- std over 3 seeds):")
    print(PAPER_TABLE_2.to_string(index=False))


if __name__ == "__main__":
    main()

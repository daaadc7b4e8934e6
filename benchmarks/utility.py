"""Accuracy of fedaudit's algorithms on Fashion-MNIST, 5 clients x 2 classes, beside the source papers' figures.

``--study dp`` (the default): FedLAP-DP, DP-FedAvg and DP-FedProx at equal data access. The paper's setting
(sigma = 1, B = 256, the authors' DP configurations) at a reduced ConvNet width so that a few rounds fit in about
an hour on a 2-core CPU. The baselines run as many local steps (DP queries) per round as FedLAP-DP's worst case
T = R_i * L * R_b, so every algorithm spends the same epsilon per round. Prints one table (round, epsilon, accuracy
per algorithm) next to the paper's Table 2 figures for Fashion-MNIST (width 128, full training; epsilon 2.79 is
their first round).

``--study others``: the other systems without DP (SCAFFOLD, FedDM, FedGM with labels in clear and under label DP,
Fedssyn with FedAvg inside) and FedAvg, every one with its own defaults at ``--local-epochs``; prints accuracy
after each round, wall time, the papers' anchors (FedLAP-DP's Table 1 for SCAFFOLD and FedDM, FedGM's Table 1)
and Fedssyn's rounds to FedAvg's final accuracy against FedAvg's (its generation round not counted).
``--algorithms`` trains a subset (run two processes on two cores); the table covers every run under ``--out``.

    python benchmarks/utility.py [--study dp|others] [--rounds 3] [--width 16] [--out runs/utility] [--threads 1]
                                 [--device cuda]
                                 [--smoke]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from _machine import describe

from fedaudit.config import DataConfig, FederatedConfig, ModelConfig, PrivacyConfig, RunConfig
from fedaudit.preparation import Setup, prepare
from fedaudit.training import train

PAPER_TABLE_2 = pd.DataFrame(
    {
        "epsilon": [2.79, 10.18],
        "FedLAP-DP": ["59.85 +- 1.5", "73.00 +- 0.7"],
        "DP-FedAvg": ["50.11 +- 4.2", "72.78 +- 1.3"],
        "DP-FedProx": ["54.57 +- 2.9", "71.67 +- 2.2"],
    }
)


# FedLAP-DP paper, Table 1 (Fashion-MNIST, 5 clients x 2 classes, ConvNet width 128, 60 rounds of 5 local epochs,
# no DP) and FedGM's Table 1 (Fashion-MNIST #C=2, 10 clients, one shot, labels in clear).
PAPER_ANCHORS = {
    "FedAvg": "79.67 +- 0.56 (FedLAP-DP Table 1)",
    "SCAFFOLD": "82.17 +- 0.37 (FedLAP-DP Table 1)",
    "FedDM": "83.10 +- 0.16 (FedLAP-DP Table 1)",
    "FedGM": "85.3 +- 0.1 (FedGM Table 1, 10 clients #C=2)",
    "FedGM label-eps 1": "no Fashion-MNIST figure (its label-DP results, epsilon 1, 5, 10, are MNIST plots)",
    "FedGM label-eps 5": "no Fashion-MNIST figure",
    "FedGM label-eps 10": "no Fashion-MNIST figure",
    "Fedssyn": "CIFAR-10 only: FedAvg 88 rounds to 44% without, 4 with (alpha 0.01)",
}
OTHERS = {
    "FedAvg": {"federated.algorithm": "fedavg"},
    "SCAFFOLD": {"federated.algorithm": "scaffold"},
    "Fedssyn": {"federated.algorithm": "fedssyn"},
    "FedDM": {"federated.algorithm": "feddm"},
    "FedGM": {"federated.algorithm": "fedgm"},
    **{
        f"FedGM label-eps {eps:g}": {"federated.algorithm": "fedgm", "fedgm.label_epsilon": eps}
        for eps in (1.0, 5.0, 10.0)
    },
}
ONE_SHOT = {name: 2 for name in OTHERS if name.startswith("FedGM")}  # FedGM's stages: the paper's T = 2
TITLES = {"fashion-mnist": "Fashion-MNIST", "digits": "digits"}
# --smoke: each algorithm's own loops at their smallest.
SMOKE = {
    "fedlap": {
        "fedlap.trajectories": 1,
        "fedlap.max_loops": 1,
        "fedlap.real_batches": 1,
        "fedlap.image_steps": 1,
        "fedlap.ipc": 1,
        "fedlap.server_epochs": 1,
    },
    "feddm": {"feddm.dm_iterations": 2},
    "fedgm": {"fedgm.distill_iterations": 2, "fedgm.server_steps": 5},
    "fedssyn": {"fedssyn.generator_epochs": 1},
}


def smallest(config: RunConfig, smoke: bool) -> RunConfig:
    """``config`` with its algorithm's loops at their smallest (:data:`SMOKE`) under --smoke, else unchanged."""
    return config.with_overrides(SMOKE.get(config.federated.algorithm, {})) if smoke else config


def others(args: argparse.Namespace) -> None:
    """The other systems without DP, each with its own defaults; the table covers every run under ``--out``."""
    base = RunConfig(
        seed=args.seed,
        device=args.device,
        data=DataConfig(dataset=args.dataset, partition="classes:2", num_clients=5),
        model=ModelConfig(width=args.width),
    )
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, CPU; {TITLES[args.dataset]}, 5 clients x 2 "
        f"classes, ConvNet width {args.width}, {args.local_epochs} local epoch(s), seed {args.seed}, no DP"
    )
    for name in list(OTHERS) if args.algorithms is None else args.algorithms:
        rounds = ONE_SHOT.get(name, args.rounds + (1 if name == "Fedssyn" else 0))
        config = base.with_overrides(
            {**OTHERS[name], "federated.rounds": rounds, "federated.local_epochs": args.local_epochs}
        )
        config = smallest(config, args.smoke)
        started = time.perf_counter()
        train(
            config,
            Path(args.out) / name,
            overwrite=True,
            progress=False,
            echo=lambda line, n=name: print(f"  {n}: {line}", flush=True),
        )
        print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    curves = {}
    for name in OTHERS:
        path = Path(args.out) / name / "metrics.csv"
        if not path.exists():
            continue
        metrics = pd.read_csv(path)
        curves[name] = metrics.set_index("round")["test_accuracy"]
        rows.append(
            {
                "algorithm": name,
                "rounds": len(metrics),
                "final acc %": round(100 * float(metrics["test_accuracy"].iloc[-1]), 2),
                "best acc %": round(100 * float(metrics["test_accuracy"].max()), 2),
                "wall s": round(float(metrics["wall_seconds"].sum())),
                "paper": PAPER_ANCHORS[name],
            }
        )
    print("\nThis run (accuracy after the last round; wall: the rounds' seconds):")
    print(pd.DataFrame(rows).to_string(index=False))
    print("\nAccuracy % after each round (Fedssyn's round 1 is its generation round):")
    print((100 * pd.DataFrame(curves)).round(2).to_string())
    if "FedAvg" in curves and "Fedssyn" in curves:
        target = float(curves["FedAvg"].iloc[-1])
        fedavg = _rounds_to(curves["FedAvg"], target)
        shuffled = _rounds_to(curves["Fedssyn"].iloc[1:], target)
        print(
            f"\nRounds to FedAvg's final accuracy {100 * target:.2f}%: FedAvg {fedavg}, Fedssyn "
            f"{'not reached' if shuffled is None else shuffled - 1} (training rounds after the generation round)"
        )


def _rounds_to(curve: pd.Series, target: float) -> int | None:
    """The first round whose accuracy reaches ``target``, or None."""
    reached = curve[curve >= target - 1e-12]
    return None if reached.empty else int(reached.index[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--study", choices=["dp", "others"], default="dp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--local-epochs", type=int, default=2, help="--study others only")
    parser.add_argument(
        "--algorithms",
        nargs="*",
        choices=list(OTHERS),
        help="--study others: train these only (none: only print the table of the runs under --out)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every figure is of this device)")
    parser.add_argument("--out", help="where the runs go [default: runs/utility; with --smoke a temporary folder]")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits instead of Fashion-MNIST, 1 round, width 8, 1 local epoch, every "
        "algorithm's own loops at their smallest (FedLAP: 1 of each, 1 image per class)",
    )
    args = parser.parse_args()
    args.dataset = "digits" if args.smoke else "fashion-mnist"
    if args.smoke:
        args.rounds, args.width, args.local_epochs = 1, 8, 1
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="utility-") as scratch:
        args.out = args.out or (scratch if args.smoke else "runs/utility")
        if args.study == "others":
            others(args)
        else:
            dp(args)


def dp_configs(
    *, seed: int, width: int, device: str, dataset: str, rounds: int, smoke: bool
) -> tuple[dict[str, RunConfig], Setup]:
    """FedLAP-DP, DP-FedAvg and DP-FedProx of Table 2 by name (5 clients x 2 classes, sigma 1), and FedLAP-DP's
    set-up: the baselines run its worst-case T = R_i * L * R_b DP queries a round (``max(setup.queries.values())``),
    so that all three access the same data and spend the same epsilon (loads the data once, to find T)."""
    base = RunConfig(
        seed=seed,
        device=device,
        data=DataConfig(dataset=dataset, partition="classes:2", num_clients=5),
        model=ModelConfig(width=width),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0),
    )
    lap = smallest(base.with_overrides({"federated": FederatedConfig(algorithm="fedlap", rounds=rounds)}), smoke)
    setup = prepare(lap)
    queries = max(setup.queries.values())
    baselines = {
        name: base.with_overrides(
            {"federated": FederatedConfig(algorithm=algorithm, rounds=rounds, local_steps=queries)}
        )
        for name, algorithm in (("DP-FedAvg", "fedavg"), ("DP-FedProx", "fedprox"))
    }
    return {"FedLAP-DP": lap, **baselines}, setup


def dp(args: argparse.Namespace) -> None:
    """FedLAP-DP, DP-FedAvg and DP-FedProx at equal data access, beside the paper's Table 2."""
    configs, setup = dp_configs(
        seed=args.seed,
        width=args.width,
        device=args.device,
        dataset=args.dataset,
        rounds=args.rounds,
        smoke=args.smoke,
    )
    lap, queries = configs["FedLAP-DP"], max(setup.queries.values())
    print(describe(args.device), flush=True)
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}; {TITLES[args.dataset]}, 5 clients x 2 "
        f"classes, ConvNet width {args.width}, sigma 1, B {lap.resolved().federated.batch_size}, T = {queries} DP "
        f"queries per client per round, seed {args.seed}"
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

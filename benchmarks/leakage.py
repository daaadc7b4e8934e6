"""Membership leakage with and without DP: Sec. 6.6 of the FedLAP-DP paper on Fashion-MNIST.

The paper attacks FedAvg and FedLAP, each without DP and with DP at epsilon
10.18, with a black-box attack on the loss and a white-box attack on the
gradient norm (a classifier trained on half of the members and non-members,
judged on the other half), and finds: the non-DP runs leak, FedLAP leaks less
than FedAvg even without DP, and the DP runs sit at AUC 0.5.

This script trains the four runs with ``fedaudit train`` (5 clients x 2
classes, the authors' configurations, DP runs calibrated to --epsilon after
their last round; fewer rounds and a narrower ConvNet than the paper so that it
fits in about an hour on a 2-core CPU), attacks them with ``fedaudit attack``
(loss and gradient norm; threshold and classifier; up to --max-records members
and as many non-members, since more records give the narrower intervals that
let a small leak show), writes one ``fedaudit report``, and prints every
attack's AUC with its 95% interval, the empirical epsilon lower bound, and
whether each of the paper's claims holds here. Non-DP FedLAP gets its own
round count (--fedlap-rounds): with the authors' non-DP configuration (50
images per class, 40 real batches per loop) one of its rounds took 87 minutes
on a 2-core machine. A run already complete in --out is reused, an
interrupted one resumed; the attacks are always recomputed.

    python benchmarks/leakage.py [--rounds 3] [--fedlap-rounds 1] [--width 32] [--epsilon 10]
                                 [--max-records 10000] [--out studies/leakage] [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
from _machine import add_program_option, describe, fedaudit_command, use_program

SIGNALS = ("loss", "grad-norm")
METHODS = ("threshold", "classifier")
# --smoke: FedLAP's loops at their smallest (R_i = L = R_b = J = 1, 1 image per class, 1 server epoch), FedAvg's one
# local epoch.
SMOKE_FEDLAP = [
    *("--trajectories", "1", "--max-loops", "1", "--real-batches", "1", "--image-steps", "1"),
    *("--ipc", "1", "--server-epochs", "1"),
]
SMOKE_FEDAVG = ["--local-epochs", "1"]


def run(args: list[str], env: dict[str, str]) -> None:
    print("$ fedaudit " + " ".join(args), flush=True)
    subprocess.run([*fedaudit_command(), *args], env=env, check=True)


def train(directory: Path, options: list[str], env: dict[str, str]) -> str:
    """Train the run at ``directory``, resume it if interrupted, keep it if complete; returns what was done."""
    manifest = directory / "manifest.json"
    if manifest.is_file():
        if json.loads(manifest.read_text()).get("status") == "complete":
            return "kept (complete)"
        run(["train", "--resume", str(directory), "--no-progress"], env)
        return "resumed"
    run(["train", *options, "--out", str(directory), "--no-progress"], env)
    return "trained"


def attack_rows(directories: list[Path]) -> pd.DataFrame:
    """One row per run and attack on the final model, from the runs' attacks/*/metrics.json."""
    rows = []
    for directory in directories:
        metrics_csv = pd.read_csv(directory / "metrics.csv")
        for metrics_file in sorted(directory.glob("attacks/*/metrics.json")):
            m = json.loads(metrics_file.read_text())
            rows.append(
                {
                    "run": directory.name,
                    "rounds": int(metrics_csv["round"].iloc[-1]),
                    "test acc": float(metrics_csv["test_accuracy"].iloc[-1]),
                    "attack": f"{m['signal']}/{m['method']}",
                    "AUC": m["auc"],
                    "AUC 95% interval": f"[{m['auc_ci95'][0]:.3f}, {m['auc_ci95'][1]:.3f}]",
                    "low": m["auc_ci95"][0],
                    "high": m["auc_ci95"][1],
                    "n per side": f"{m['num_members']}/{m['num_nonmembers']}",
                    "eps lower bound": m["epsilon_lower_bound"],
                    "accountant eps": m["accountant_epsilon"],
                }
            )
    return pd.DataFrame(rows)


def claims(table: pd.DataFrame) -> list[str]:
    """The paper's three claims, each checked on the intervals of this study."""

    def runs(prefix: str) -> pd.DataFrame:
        return table[table["run"].str.startswith(prefix)]

    lines = []
    for name, prefix in (("FedAvg", "fedavg-nodp"), ("FedLAP", "fedlap-nodp")):
        leaking = runs(prefix)[runs(prefix)["low"] > 0.5]
        lines.append(
            f"- non-DP {name} leaks (some attack's AUC interval above 0.5): "
            f"{'holds' if len(leaking) else 'not seen'} ({len(leaking)} of {len(runs(prefix))} attacks)"
        )
    avg, lap = runs("fedavg-nodp").set_index("attack"), runs("fedlap-nodp").set_index("attack")
    common = avg.index.intersection(lap.index)
    below = [a for a in common if lap.loc[a, "high"] < avg.loc[a, "low"]]
    lower = [a for a in common if lap.loc[a, "AUC"] < avg.loc[a, "AUC"]]
    lines.append(
        f"- non-DP FedLAP leaks less than non-DP FedAvg: lower AUC in {len(lower)} of {len(common)} attacks, "
        f"with disjoint intervals in {len(below)}"
    )
    dp = table[table["run"].str.contains("-eps")]
    chance = dp[(dp["low"] <= 0.5) & (dp["high"] >= 0.5)]
    lines.append(f"- DP runs sit at AUC 0.5 (interval covers 0.5): {len(chance)} of {len(dp)} attacks")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fedlap-rounds", type=int, default=1, help="rounds of the non-DP FedLAP run")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--epsilon", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-records", type=int, default=10000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", help="where the runs and the report go [default: studies/leakage; with --smoke a temporary folder]"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits instead of Fashion-MNIST, three of the four runs (not DP-FedAvg), "
        "1 round each, width 8, FedAvg's 1 local epoch, FedLAP's loops at 1 (1 image per class), 100 records attacked",
    )
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    if args.smoke:
        args.rounds, args.fedlap_rounds, args.width, args.max_records = 1, 1, 8, 100
    with tempfile.TemporaryDirectory(prefix="leakage-") as scratch:
        args.out = args.out or (scratch if args.smoke else "studies/leakage")
        study(args)


def study(args: argparse.Namespace) -> None:
    """Train (or reuse) the four runs (three with --smoke) under ``args.out``, attack them, report, and print the
    table and the claims."""
    dataset = "digits" if args.smoke else "fashion-mnist"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    common = [
        "--dataset",
        dataset,
        "--partition",
        "classes:2",
        "--num-clients",
        "5",
        "--width",
        str(args.width),
        "--device",
        "cpu",
        "--seed",
        str(args.seed),
    ]
    dp = ["--dp", "--target-epsilon", f"{args.epsilon:g}"]
    eps = f"eps{args.epsilon:g}"
    lap, avg = (SMOKE_FEDLAP, SMOKE_FEDAVG) if args.smoke else ([], [])
    plan = {
        f"fedavg-nodp-seed{args.seed}": ["--algorithm", "fedavg", "--rounds", str(args.rounds), *avg],
        f"fedavg-{eps}-seed{args.seed}": ["--algorithm", "fedavg", "--rounds", str(args.rounds), *dp, *avg],
        f"fedlap-nodp-seed{args.seed}": ["--algorithm", "fedlap", "--rounds", str(args.fedlap_rounds), *lap],
        f"fedlap-{eps}-seed{args.seed}": ["--algorithm", "fedlap", "--rounds", str(args.rounds), *dp, *lap],
    }
    if args.smoke:
        # Each run is a fedaudit process of its own (seconds of imports). The other three still train both algorithms
        # with and without DP (FedLAP-DP with FedLAP's loops), FedLAP's own round count, and feed every claim.
        del plan[f"fedavg-{eps}-seed{args.seed}"]
    print(describe("cpu", 1), flush=True)
    print(
        f"{'digits' if args.smoke else 'Fashion-MNIST'}, 5 clients x 2 classes, ConvNet width {args.width}, "
        f"{args.rounds} rounds ({args.fedlap_rounds} for non-DP FedLAP), DP runs at epsilon {args.epsilon:g} "
        f"(delta 1e-5), seed {args.seed}, up to {args.max_records} members and as many non-members attacked, "
        f"{args.threads} torch thread(s), CPU",
        flush=True,
    )
    directories = []
    for name, options in plan.items():
        directory = Path(args.out) / "runs" / name
        started = time.perf_counter()
        done = train(directory, [*common, *options], env)
        print(f"  {name}: {done} ({time.perf_counter() - started:.0f} s)", flush=True)
        directories.append(directory)
    started = time.perf_counter()
    run(
        [
            "attack",
            *map(str, directories),
            *[f"--signal={s}" for s in SIGNALS],
            *[f"--method={m}" for m in METHODS],
            "--max-records",
            str(args.max_records),
            "--device",
            "cpu",
            "--no-progress",
        ],
        env,
    )
    print(f"  attacks: {time.perf_counter() - started:.0f} s", flush=True)
    run(
        [
            "report",
            *map(str, directories),
            "--out",
            str(Path(args.out) / "report"),
            "--format",
            "html",
            "--format",
            "md",
            "--overwrite",  # the runs are reused from an earlier study; their report is rebuilt
        ],
        env,
    )
    table = attack_rows(directories)
    print()
    print(table.drop(columns=["low", "high"]).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print("\nThe paper's claims (Sec. 6.6), judged on the 95% intervals above:")
    print("\n".join(claims(table)))


if __name__ == "__main__":
    main()

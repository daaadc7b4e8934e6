"""Membership leakage with and without DP: Sec. 6.6 of the FedLAP-DP paper on Fashion-MNIST.

The paper attacks FedAvg and FedLAP, each without DP and with DP at epsilon
10.18, with a black-box attack on the loss and a white-box attack on the
gradient norm (a classifier trained on half of the members and non-members,
judged on the other half), and finds: the non-DP runs leak, FedLAP leaks less
than FedAvg even without DP, and the DP runs sit at AUC 0.5.

This script runs the same comparison as one ``fedaudit compare`` study (5
clients x 2 classes, the authors' configurations, DP runs calibrated to
epsilon 10 after the last round; fewer rounds and a narrower ConvNet than the
paper so that it fits in about an hour on a 2-core CPU), then prints every
attack's AUC with its 95% interval, the empirical epsilon lower bound, and
whether each of the paper's claims holds here. Running it again reuses what the
study directory already holds.

    python benchmarks/leakage.py [--rounds 3] [--width 32] [--epsilon 10] [--max-records 10000] [--out studies/leakage]
                                 [--threads 1]

Up to --max-records members and as many non-members are attacked (the held-out
pool and the test split): more records give narrower intervals, which is what
lets a small leak show.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

SIGNALS = ("loss", "grad-norm")
METHODS = ("threshold", "classifier")


def fedaudit_command() -> list[str]:
    """The fedaudit CLI of the interpreter running this script."""
    script = Path(sys.executable).with_name("fedaudit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cli"]


def attack_rows(study: Path) -> pd.DataFrame:
    """One row per run and attack on the final model, from the runs' attacks/*/metrics.json."""
    rows = []
    for metrics_file in sorted(study.glob("runs/*/attacks/*/metrics.json")):
        m = json.loads(metrics_file.read_text())
        rows.append({
            "run": metrics_file.parent.parent.parent.name,
            "attack": f"{m['signal']}/{m['method']}",
            "AUC": m["auc"],
            "AUC 95% interval": f"[{m['auc_ci95'][0]:.3f}, {m['auc_ci95'][1]:.3f}]",
            "low": m["auc_ci95"][0],
            "high": m["auc_ci95"][1],
            "n per side": f"{m['num_members']}/{m['num_nonmembers']}",
            "eps lower bound": m["epsilon_lower_bound"],
            "accountant eps": m["accountant_epsilon"],
        })
    return pd.DataFrame(rows)


def claims(table: pd.DataFrame) -> list[str]:
    """The paper's three claims, each checked on the intervals of this study."""
    def runs(prefix: str) -> pd.DataFrame:
        return table[table["run"].str.startswith(prefix)]

    lines = []
    for name, prefix in (("FedAvg", "fedavg-nodp"), ("FedLAP", "fedlap-nodp")):
        leaking = runs(prefix)[runs(prefix)["low"] > 0.5]
        lines.append(f"- non-DP {name} leaks (some attack's AUC interval above 0.5): "
                     f"{'holds' if len(leaking) else 'not seen'} ({len(leaking)} of {len(runs(prefix))} attacks)")
    avg, lap = runs("fedavg-nodp").set_index("attack"), runs("fedlap-nodp").set_index("attack")
    common = avg.index.intersection(lap.index)
    below = [a for a in common if lap.loc[a, "high"] < avg.loc[a, "low"]]
    lower = [a for a in common if lap.loc[a, "AUC"] < avg.loc[a, "AUC"]]
    lines.append(f"- non-DP FedLAP leaks less than non-DP FedAvg: lower AUC in {len(lower)} of {len(common)} attacks, "
                 f"with disjoint intervals in {len(below)}")
    dp = table[table["run"].str.contains("-eps")]
    chance = dp[(dp["low"] <= 0.5) & (dp["high"] >= 0.5)]
    lines.append(f"- DP runs sit at AUC 0.5 (interval covers 0.5): {len(chance)} of {len(dp)} attacks")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--epsilon", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-records", type=int, default=10000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="studies/leakage")
    args = parser.parse_args()
    study = Path(tempfile.mkdtemp()) / "attack.yaml"  # the one attack setting compare takes only from a study file
    study.write_text(f"attack: {{max_records: {args.max_records}}}\n")
    command = [
        *fedaudit_command(), "compare", "--study", str(study), "--out", args.out, "--dataset", "fashion-mnist", "--partition", "classes:2",
        "--num-clients", "5", "--width", str(args.width), "--rounds", str(args.rounds), "--device", "cpu",
        "--algorithm", "fedavg", "--algorithm", "fedlap", "--budget", "none", "--budget", f"epsilon:{args.epsilon:g}",
        "--seed", str(args.seed), *[f"--signal={s}" for s in SIGNALS], *[f"--method={m}" for m in METHODS],
        "--format", "html", "--no-progress",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    print(f"Fashion-MNIST, 5 clients x 2 classes, ConvNet width {args.width}, {args.rounds} rounds, DP runs at "
          f"epsilon {args.epsilon:g} (delta 1e-5), seed {args.seed}, up to {args.max_records} members and as many "
          f"non-members attacked, {args.threads} torch thread(s), CPU")
    print(f"$ {' '.join(command[1:])}  # {study.name}: max_records {args.max_records}", flush=True)
    started = time.perf_counter()
    try:
        subprocess.run(command, env=env, check=True)
    finally:
        shutil.rmtree(study.parent)
    print(f"\nStudy took {time.perf_counter() - started:.0f} s (runs already in {args.out} are reused)\n")
    table = attack_rows(Path(args.out))
    shown = table.drop(columns=["low", "high"])
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print("\nThe paper's claims (Sec. 6.6), judged on the 95% intervals above:")
    print("\n".join(claims(table)))


if __name__ == "__main__":
    main()

"""How much of its budget a canary audit can demonstrate: DP-FedAvg with gradient canaries, one training run each.

For each dataset and accountant's epsilon this trains DP-FedAvg with ``fedaudit train --dp --target-epsilon E
--canaries M`` (5 clients x 2 classes), audits it with ``fedaudit attack --method canary`` (the server sees every
client update of every round) and prints the audited lower bound, the accountant's epsilon, their ratio, the number
of canaries and the time it took. The ratio is the audit's power: 1 would mean the accountant is tight and the audit
proves it; Steinke et al. reached about 0.45 with white-box canaries in central DP-SGD at epsilon 8.

    python benchmarks/audit_power.py [--datasets digits fashion-mnist] [--epsilons 2 4 8] [--canaries 5000]
                                     [--rounds 10] [--local-epochs 3] [--width 32] [--out studies/audit-power]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def fedaudit_command() -> list[str]:
    """The fedaudit CLI of the interpreter running this script."""
    script = Path(sys.executable).with_name("fedaudit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fedaudit.cli"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[2.0, 4.0, 8.0])
    parser.add_argument("--canaries", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=3)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--model", default="convnet")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("studies/audit-power"))
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    print(
        f"DP-FedAvg, 5 clients x 2 classes, {args.model} width {args.width}, {args.rounds} rounds of "
        f"{args.local_epochs} local epochs, {args.canaries} gradient canaries, CPU, {args.threads} thread(s)"
    )
    print(
        f"{'dataset':<14} {'eps':>5} {'eps_lb':>7} {'ratio':>6} {'AUC':>6} {'m':>6} {'train (s)':>10} {'audit (s)':>10}"
    )
    for dataset in args.datasets:
        for epsilon in args.epsilons:
            out = args.out / f"{dataset}-eps{epsilon:g}"
            train = [
                "train", "--dataset", dataset, "--dp", "--target-epsilon", f"{epsilon:g}", "--canaries",
                str(args.canaries), "--rounds", str(args.rounds), "--local-epochs", str(args.local_epochs), "--model",
                args.model, "--width", str(args.width), "--device", "cpu", "--no-progress", "--out", str(out),
                "--overwrite",
            ]  # fmt: skip
            began = time.perf_counter()
            subprocess.run([*fedaudit_command(), *train], env=env, check=True, stdout=subprocess.DEVNULL)
            trained = time.perf_counter()
            attack = ["attack", str(out), "--method", "canary", "--no-progress", "--device", "cpu"]
            subprocess.run([*fedaudit_command(), *attack], env=env, check=True, stdout=subprocess.DEVNULL)
            audited = time.perf_counter()
            metrics = json.loads((out / "attacks" / "update-projection-canary" / "metrics.json").read_text())
            bound, accountant = metrics["epsilon_lower_bound"], metrics["accountant_epsilon"]
            print(
                f"{dataset:<14} {accountant:>5.2f} {bound:>7.3f} {bound / accountant:>6.3f} {metrics['auc']:>6.3f} "
                f"{metrics['canary_audit']['canaries']:>6d} {trained - began:>10.1f} {audited - trained:>10.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""How strong fedaudit's attacks are on a run that leaks: threshold and population attacks against LiRA and RMIA with
K reference models, and the same attacks on the DP version of the run.

For each dataset this trains a FedAvg run without DP whose clients overfit (few records each, many rounds), and
one with DP-SGD at the same settings, then runs ``fedaudit attack`` with the loss threshold and population
attacks, and with LiRA and RMIA (offline) for each K. References nest: K = 8 reuses the 4 of K = 4, so the time of a
row is the time of the references it added plus the attack. Printed per attack: AUC with its 95% interval, TPR at 1%
and 0.1% FPR with their intervals, and the seconds it took; then RMIA's TPR at 1% FPR over the threshold attack's
(the target: at least 2 with 4 references) and RMIA against LiRA at equal K (the paper's ordering).

    python benchmarks/attack_strength.py [--datasets digits fashion-mnist] [--references 1 2 4 8]
                                         [--out studies/attack-strength] [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _machine import add_program_option, describe, fedaudit_command, use_program

# Settings that make a non-DP FedAvg run leak (loss threshold AUC >= 0.6): few records per client (the rest of the
# training split is held out), a wide MLP, many rounds at a constant step. Digits reaches 0.6 only with 144 members,
# too few to measure TPR at 1% FPR; Fashion-MNIST with 600.
LEAKY = {
    "digits": "--model mlp --width 512 --depth 2 --num-clients 5 --partition iid --rounds 60 --local-epochs 2 "
    "--batch-size 16 --lr 0.1 --lr-schedule constant --holdout-fraction 0.9",
    "fashion-mnist": "--model mlp --width 512 --depth 2 --num-clients 5 --partition iid --rounds 60 --local-epochs 2 "
    "--batch-size 16 --lr 0.1 --lr-schedule constant --holdout-fraction 0.99",
}
# --smoke: the same recipe at its smallest (it need not leak), on digits.
SMOKE = (
    "--model mlp --width 8 --depth 1 --num-clients 2 --partition iid --rounds 1 --local-epochs 1 --batch-size 16 "
    "--lr 0.1 --lr-schedule constant --holdout-fraction 0.9"
)


def call(args: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    subprocess.run([*fedaudit_command(), *args], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def rate(entry: dict) -> str:
    if not entry.get("estimable"):
        return "n/e"
    low, high = entry["ci95"]
    return f"{entry['tpr']:.3f} [{low:.3f}, {high:.3f}]"


def row(run: Path, name: str, label: str, seconds: float) -> dict:
    metrics = json.loads((run / "attacks" / name / "metrics.json").read_text())
    low, high = metrics["auc_ci95"]
    rates = metrics["tpr_at_fpr"]
    print(
        f"  {label:<22} AUC {metrics['auc']:.3f} [{low:.3f}, {high:.3f}]  TPR@1% {rate(rates['0.01']):<22} "
        f"TPR@0.1% {rate(rates['0.001']):<22} {seconds:7.1f} s",
        flush=True,
    )
    return metrics


def ratio(attack: dict, reference: dict) -> str:
    """TPR at 1% FPR of ``attack`` over ``reference``'s: "n/e" where either is not estimable, "inf" over zero."""
    a, b = attack["tpr_at_fpr"]["0.01"], reference["tpr_at_fpr"]["0.01"]
    if not (a.get("estimable") and b.get("estimable")):
        return "n/e"
    return "inf" if not b["tpr"] else f"{a['tpr'] / b['tpr']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"])
    parser.add_argument("--references", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--epsilon", type=float, default=4.0, help="the DP run's target epsilon (delta 1e-5)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, help="where the runs go [default: studies/attack-strength; with --smoke a temporary folder]"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits only, the DP run only, K=1, an MLP of width 8 on 2 clients for 1 round",
    )
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    if args.smoke:
        args.datasets, args.references = ["digits"], [1]
    with tempfile.TemporaryDirectory(prefix="attack-strength-") as scratch:
        study(args, args.out or (Path(scratch) if args.smoke else Path("studies/attack-strength")))


def study(args: argparse.Namespace, out: Path) -> None:
    """Train, attack and print every dataset's runs (without and with DP; with --smoke only DP) under ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    print(describe("cpu", args.threads), flush=True)
    print(f"CPU, {args.threads} thread(s); attacks on the final model, offline references")
    for dataset in args.datasets:
        recipe = SMOKE if args.smoke else LEAKY[dataset]
        for dp in (True,) if args.smoke else (False, True):
            run = out / f"{dataset}-{'dp' if dp else 'nodp'}"
            privacy = ["--dp", "--target-epsilon", f"{args.epsilon:g}"] if dp else []
            train = ["train", "--dataset", dataset, *recipe.split(), *privacy, "--device", "cpu"]
            seconds = call([*train, "--no-progress", "--out", str(run), "--overwrite"], env)
            accuracy = (run / "metrics.csv").read_text().splitlines()[-1].split(",")[1]
            label = f"DP-FedAvg at epsilon {args.epsilon:g}" if dp else "FedAvg without DP"
            print(f"{dataset}, {label}: {recipe} (trained in {seconds:.0f} s, test accuracy {accuracy})")
            base = ["attack", str(run), "--no-progress", "--device", "cpu"]
            seconds = call([*base, "--signal", "loss", "--method", "threshold", "--method", "population"], env)
            threshold = row(run, "loss-threshold", "loss threshold", seconds)
            row(run, "loss-population", "loss population", seconds)
            for k in args.references:
                seconds = call([*base, "--signal", "logit-confidence", "--method", "lira", "--method", "rmia",
                                "--references", str(k)], env)  # fmt: skip
                lira = row(run, "logit-confidence-lira", f"LiRA offline, K={k}", seconds)
                rmia = row(run, "logit-confidence-rmia", f"RMIA offline, K={k}", 0.0)
                print(f"  {'':<22} RMIA / threshold TPR@1%: {ratio(rmia, threshold)}; RMIA - LiRA AUC: "
                      f"{rmia['auc'] - lira['auc']:+.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""How much of its budget a canary audit can demonstrate, from one training run each.

For each dataset, algorithm, kind of canary and accountant's epsilon this trains with ``fedaudit train --dp
--target-epsilon E --canaries M --canary-kind K`` (5 clients x 2 classes), audits it with ``fedaudit attack --method
canary`` and prints, for every view of the audit (what crossed the wire: client updates or FedLAP-DP's synthetic
sets; for input canaries also the final model), the audited lower bound, the accountant's epsilon, their ratio, the
canary AUC, the number of canaries and how many of them were informative (their client took part), and the times
of training, the audit and ``fedaudit verify`` (with its verdict). The ratio is the audit's power: 1 would mean the
accountant is tight and the audit proves it; Steinke et al. reached about 0.45 with white-box canaries in central
DP-SGD at epsilon 8. Beside the rigorous bound each view prints the two-Gaussian estimate of epsilon (an estimate,
not a bound: Andrew et al.), its 95% bootstrap interval and its ratio to the accountant's epsilon. Input canaries
are held-out records, so their count is capped by the held-out pool (``--holdout-fraction``).

    python benchmarks/audit_power.py [--datasets digits fashion-mnist] [--algorithms fedavg fedlap]
                                     [--kinds gradient input] [--epsilons 2 4 8] [--canaries 5000]
                                     [--input-canaries 500] [--holdout-fraction 0.4] [--rounds 10]
                                     [--local-epochs 3] [--width 32] [--out studies/audit-power] [--smoke]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg"])
    parser.add_argument("--kinds", nargs="+", default=["gradient"])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[2.0, 4.0, 8.0])
    parser.add_argument("--canaries", type=int, default=5000)
    parser.add_argument("--input-canaries", type=int, default=500)
    parser.add_argument("--holdout-fraction", type=float, default=0.4, help="for input canaries")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=3, help="FedAvg only")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--model", default="convnet")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--extra", default="", help="further train options, for example '--real-batches 5'")
    parser.add_argument(
        "--out", type=Path, help="where the runs go [default: studies/audit-power; with --smoke a temporary folder]"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits, FedAvg, gradient canaries, epsilon 8 only; 100 canaries, 1 round of "
        "1 local epoch, width 8",
    )
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    if args.smoke:
        args.datasets, args.algorithms, args.kinds, args.epsilons = ["digits"], ["fedavg"], ["gradient"], [8.0]
        args.canaries, args.input_canaries, args.rounds, args.local_epochs, args.width = 100, 20, 1, 1, 8
    with tempfile.TemporaryDirectory(prefix="audit-power-") as scratch:
        args.out = args.out or (Path(scratch) if args.smoke else Path("studies/audit-power"))
        study(args)


def study(args: argparse.Namespace) -> None:
    """Print the table's header, then train and audit every run."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    print(describe("cpu", 1), flush=True)
    print(
        f"5 clients x 2 classes, {args.model} width {args.width}, {args.rounds} rounds (FedAvg: {args.local_epochs} "
        f"local epochs), {args.canaries} gradient / {args.input_canaries} input canaries, CPU, {args.threads} thread(s)"
    )
    print(
        "eps: accountant; eps_lb: rigorous one-run lower bound (95%); est: two-Gaussian estimate of epsilon (not a "
        "bound) with its 95% bootstrap interval; m: canaries; inf: informative canaries"
    )
    print(
        f"{'dataset':<14} {'algorithm':<9} {'canaries':<9} {'view':<19} {'eps':>5} {'eps_lb':>7} {'ratio':>6} "
        f"{'est':>6} {'est 95% CI':>15} {'est/eps':>7} {'AUC':>6} {'m':>6} {'inf':>6} {'train (s)':>10} "
        f"{'audit (s)':>10} {'verify (s)':>10} {'verify':<8}"
    )
    for dataset in args.datasets:
        for algorithm in args.algorithms:
            for kind in args.kinds:
                for epsilon in args.epsilons:
                    run(args, env, dataset, algorithm, kind, epsilon)


def run(args: argparse.Namespace, env: dict[str, str], dataset: str, algorithm: str, kind: str, epsilon: float) -> None:
    """Train and audit one run; print one row per view of its audit."""
    out = args.out / f"{dataset}-{algorithm}-{kind}-eps{epsilon:g}"
    count = args.canaries if kind == "gradient" else args.input_canaries
    train = [
        "train", "--dataset", dataset, "--algorithm", algorithm, "--dp", "--target-epsilon", f"{epsilon:g}",
        "--canaries", str(count), "--canary-kind", kind, "--rounds", str(args.rounds), "--model", args.model,
        "--width", str(args.width), "--device", "cpu", "--no-progress", "--out", str(out), "--overwrite",
        *args.extra.split(),
    ]  # fmt: skip
    if algorithm != "fedlap":
        train += ["--local-epochs", str(args.local_epochs)]
    if kind == "input":
        train += ["--holdout-fraction", f"{args.holdout_fraction:g}"]
    began = time.perf_counter()
    subprocess.run([*fedaudit_command(), *train], env=env, check=True, stdout=subprocess.DEVNULL)
    trained = time.perf_counter()
    attack = ["attack", str(out), "--method", "canary", "--no-progress", "--device", "cpu"]
    subprocess.run([*fedaudit_command(), *attack], env=env, check=True, stdout=subprocess.DEVNULL)
    audited = time.perf_counter()
    verdict = verify(out, env)
    verified = time.perf_counter()
    for path in sorted((out / "attacks").glob("*-canary/metrics.json"), reverse=True):
        metrics = json.loads(path.read_text())
        bound, accountant = metrics["epsilon_lower_bound"], metrics["accountant_epsilon"]
        audit = metrics["canary_audit"]
        print(
            f"{dataset:<14} {algorithm:<9} {kind:<9} {metrics['signal']:<19} {accountant:>5.2f} {bound:>7.3f} "
            f"{bound / accountant:>6.3f} {estimate_columns(audit['estimate'], accountant)} {metrics['auc']:>6.3f} "
            f"{audit['canaries']:>6d} {audit['informative_canaries']:>6d} {trained - began:>10.1f} "
            f"{audited - trained:>10.1f} {verified - audited:>10.1f} {verdict:<8}",
            flush=True,
        )


def verify(out: Path, env: dict[str, str]) -> str:
    """Run ``fedaudit verify`` on a run: PASS, FAIL with the failed checks' names, or ERROR with its exit code."""
    done = subprocess.run(
        [*fedaudit_command(), "verify", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if done.returncode == 0:
        return "PASS"
    report = out / "verification.json"
    if done.returncode == 1 and report.exists():
        failed = [check["name"] for check in json.loads(report.read_text())["checks"] if not check["passed"]]
        return f"FAIL ({', '.join(failed)})"
    return f"ERROR (exit {done.returncode}: {done.stderr.strip()[-200:]})"


def estimate_columns(estimate: dict | None, accountant: float) -> str:
    """The two-Gaussian estimate, its 95% interval and its ratio to the accountant, or dashes where there is none."""
    if estimate is None:
        return f"{'-':>6} {'-':>15} {'-':>7}"
    low, high = estimate["ci95"]
    interval = f"[{low:.2f}, {high:.2f}]"
    return f"{estimate['epsilon']:>6.2f} {interval:>15} {estimate['epsilon'] / accountant:>7.3f}"


if __name__ == "__main__":
    main()

"""The FedLAP-DP paper's Table 2 on this machine: FedLAP-DP, DP-FedAvg and DP-FedProx over seeds, at the paper's two
privacy budgets.

Fashion-MNIST, 5 clients x 2 classes, ConvNet width 128, sigma 1, the paper's batch and loops, equal data access (the
baselines run FedLAP-DP's worst-case T queries a round: utility.py's configurations). The rounds trained are the most
that the largest budget allows under fedaudit's accountant (every client spends the same epsilon a round); each
budget's row reads every run at the last round whose epsilon is within it and gives the mean +- standard deviation
over the seeds (the sample standard deviation, as the paper's "+-" over 3 seeds), beside the paper's figure and
whether the mean lies within the paper's standard deviation of it.

Each run is a ``fedaudit train`` process of its own, ``--jobs`` of them at once, one torch thread each: on a GPU a
run is bound by its host thread, not by the device, so nine runs at once on a 16-core GPU machine take about as long
as the slowest one. Accuracy does not depend on what runs beside it; the wall times printed do.

    python benchmarks/table2.py [--seeds 0 1 2] [--width 128] [--epsilons 2.79 10.18] [--jobs 9] [--device cuda]
                                [--out runs/table2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from _machine import add_program_option, describe, fedaudit_command, use_program
from utility import PAPER_TABLE_2, TITLES, dp_configs

from fedaudit.preparation import Setup
from fedaudit.privacy.accounting import epsilon_per_round

ALGORITHMS = ("FedLAP-DP", "DP-FedAvg", "DP-FedProx")
PAPER_EPSILONS = tuple(float(e) for e in PAPER_TABLE_2["epsilon"])


@dataclass
class Job:
    """One run of the table: its configuration file, run directory and log, and its process once started."""

    name: str
    seed: int
    config: Path
    out: Path
    log: Path
    process: subprocess.Popen | None = None
    began: float = 0.0
    seconds: float = math.nan


def epsilon_curve(setup: Setup, rounds: int) -> list[float]:
    """The largest client epsilon after each of ``rounds`` rounds of ``setup``'s run (every client takes part in every
    round of this federation)."""
    privacy = setup.config.privacy
    curves = [
        epsilon_per_round(
            noise_multiplier=privacy.noise_multiplier,
            sample_rate=setup.sample_rates[client],
            queries_per_round=setup.queries[client],
            rounds=rounds,
            delta=privacy.delta,
            accountant=privacy.accountant,
        )
        for client in setup.queries
    ]
    return [max(values) for values in zip(*curves)]


def rounds_within(curve: list[float], budget: float) -> int:
    """How many rounds the budget allows: the last round whose epsilon is within it (0: not even the first)."""
    return sum(1 for epsilon in curve if epsilon <= budget * (1 + 1e-9))


def run_all(jobs: list[Job], at_once: int, threads: int) -> None:
    """Train every job, ``at_once`` processes at a time; stops the ones still running (by pid) if one fails or the
    wait is interrupted."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    waiting, running = list(jobs), []
    try:
        while waiting or running:
            while waiting and len(running) < at_once:
                job = waiting.pop(0)
                command = [*fedaudit_command(), "train", "--config", str(job.config), "--out", str(job.out)]
                with job.log.open("w") as log:
                    job.process = subprocess.Popen(
                        [*command, "--overwrite", "--no-progress"], stdout=log, stderr=subprocess.STDOUT, env=env
                    )
                job.began = time.perf_counter()
                running.append(job)
            time.sleep(0.2)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                job.seconds = time.perf_counter() - job.began
                if job.process.returncode != 0:
                    tail = job.log.read_text()[-2000:]
                    raise SystemExit(f"{job.name}, seed {job.seed} failed (exit {job.process.returncode}):\n{tail}")
                print(f"  {job.name}, seed {job.seed}: {job.seconds:.0f} s; {_accuracy_line(job)}", flush=True)
    finally:
        for job in running:
            if job.process.poll() is None:
                job.process.kill()
                job.process.wait()


def _accuracy_line(job: Job) -> str:
    """A finished run's test accuracy after each round, as soon as it is done (a call cut short keeps these)."""
    metrics = pd.read_csv(job.out / "metrics.csv")
    return "accuracy % by round: " + " ".join(
        f"{int(r)}:{100 * a:.2f}" for r, a in zip(metrics["round"], metrics["test_accuracy"])
    )


def accuracies(
    jobs: list[Job], budgets: list[float], curves: dict[int, list[float]]
) -> dict[tuple[float, str], list[float]]:
    """Test accuracy (%) of every run at each budget's round (its seed's last round within the budget), by (budget,
    algorithm), in seed order. Every run's own ledger must have spent its seed's planned epsilon at that round."""
    found: dict[tuple[float, str], list[float]] = {}
    for job in jobs:
        metrics = pd.read_csv(job.out / "metrics.csv").set_index("round")
        curve = curves[job.seed]
        for budget in budgets:
            rounds = rounds_within(curve, budget)
            if not rounds:
                continue
            spent = float(metrics.loc[rounds, "epsilon"])
            if not math.isclose(spent, curve[rounds - 1], rel_tol=1e-6):
                raise SystemExit(
                    f"{job.name}, seed {job.seed} spent epsilon {spent} at round {rounds}, not the planned "
                    f"{curve[rounds - 1]}"
                )
            found.setdefault((budget, job.name), []).append(100 * float(metrics.loc[rounds, "test_accuracy"]))
    return found


def spread(values: list[float]) -> str:
    """mean +- sample standard deviation (mean alone for one seed)."""
    if len(values) < 2:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} +- {statistics.stdev(values):.2f}"


def verdict(values: list[float], paper: str) -> str:
    """Whether the mean lies within the paper's standard deviation of the paper's mean, and by how much it differs."""
    mean, sd = (float(part) for part in paper.split("+-"))
    gap = statistics.mean(values) - mean
    return f"{'within' if abs(gap) <= sd else 'outside'} ({gap:+.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(PAPER_EPSILONS), help="the budgets")
    parser.add_argument("--max-rounds", type=int, default=100, help="at most this many rounds, whatever the budget")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--out", type=Path, help="where the runs go [default: runs/table2; with --smoke a temporary one]"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits, width 8, seeds 0 and 1, FedLAP's loops at their smallest, the budgets "
        "of rounds 1 and 2, two runs at once",
    )
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    # a time limit's SIGTERM (timeout(1)) ends the runs too, by run_all's finally, instead of leaving them running
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    dataset = "digits" if args.smoke else "fashion-mnist"
    if args.smoke:
        args.seeds, args.width, args.max_rounds, args.jobs = [0, 1], 8, 2, 2
    with tempfile.TemporaryDirectory(prefix="table2-") as scratch:
        table(args, dataset, args.out or (Path(scratch) if args.smoke else Path("runs/table2")))


def table(args: argparse.Namespace, dataset: str, out: Path) -> None:
    """Plan the rounds, train every run, print the table."""
    configs = {
        seed: dp_configs(seed=seed, width=args.width, device=args.device, dataset=dataset, rounds=1, smoke=args.smoke)
        for seed in args.seeds
    }
    queries = max(configs[args.seeds[0]][1].queries.values())
    # A seed's partition decides its clients' sample rates, and so its epsilon curve (on Fashion-MNIST every client
    # holds two whole classes, and every seed's curve is the same).
    curves = {seed: epsilon_curve(setup, args.max_rounds) for seed, (_, setup) in configs.items()}
    if args.smoke:
        args.epsilons = [max(curve[r] for curve in curves.values()) for r in (0, 1)]
    rounds = {seed: max(1, *(rounds_within(curve, b) for b in args.epsilons)) for seed, curve in curves.items()}
    print(describe(args.device, args.threads), flush=True)
    print(
        f"{TITLES[dataset]}, 5 clients x 2 classes, ConvNet width {args.width}, sigma 1, T = {queries} DP queries per "
        f"client per round, seeds {' '.join(map(str, args.seeds))}; {span(rounds.values())} round(s); {args.jobs} "
        f"run(s) at once, {args.threads} torch thread(s) each",
        flush=True,
    )
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    jobs = []
    for seed, (named, _) in configs.items():
        for name in ALGORITHMS:
            config = named[name].with_overrides({"federated.rounds": rounds[seed]})
            slug = f"seed{seed}-{name.lower()}"
            path = out / "configs" / f"{slug}.json"
            path.write_text(json.dumps(config.to_dict(), indent=1))
            jobs.append(Job(name, seed, path, out / slug, out / "logs" / f"{slug}.log"))
    started = time.perf_counter()
    run_all(jobs, max(1, args.jobs), args.threads)
    print(f"all {len(jobs)} runs: {time.perf_counter() - started:.0f} s")
    found = accuracies(jobs, args.epsilons, curves)
    paper = PAPER_TABLE_2.set_index("epsilon")
    print(f"\n{'budget':>7} {'round':>5} {'epsilon':>7}  " + "  ".join(f"{name + ' acc %':>24}" for name in ALGORITHMS))
    for budget in args.epsilons:
        within = [rounds_within(curve, budget) for curve in curves.values()]
        if not all(within):
            print(f"{budget:>7.2f}     - (a first round spends {max(c[0] for c in curves.values()):.2f})")
            continue
        spent = max(curve[r - 1] for curve, r in zip(curves.values(), within))
        cells = [spread(found[(budget, name)]) for name in ALGORITHMS]
        print(f"{budget:>7.2f} {span(within):>5} {spent:>7.2f}  " + "  ".join(f"{c:>24}" for c in cells))
        if budget in paper.index and not args.smoke:
            print(f"{'paper':>21}  " + "  ".join(f"{paper.loc[budget, name]:>24}" for name in ALGORITHMS))
            checks = [verdict(found[(budget, name)], paper.loc[budget, name]) for name in ALGORITHMS]
            print(f"{'mean vs paper sd':>21}  " + "  ".join(f"{c:>24}" for c in checks))
    print("\nEach run's accuracy % (seed order) and wall seconds:")
    for name in ALGORITHMS:
        cells = "; ".join(
            f"eps {budget:.2f}: " + ", ".join(f"{a:.2f}" for a in found[(budget, name)])
            for budget in args.epsilons
            if (budget, name) in found
        )
        seconds = ", ".join(f"{job.seconds:.0f}" for job in jobs if job.name == name)
        print(f"  {name}: {cells}; {seconds} s")


def span(values) -> str:
    """``3`` where every value is 3, ``2-3`` where they range."""
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


if __name__ == "__main__":
    main()

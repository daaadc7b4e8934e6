"""What DP costs a cross-device federation: its time over the same federation without DP, as the median of paired,
alternated runs.

Fashion-MNIST split IID over K clients (1,000: about 60 records each), 2% of them a round, batch 16, 20 rounds,
test accuracy every 10 rounds on 2,000 test records, one torch thread: DP-FedAvg at sigma 1 (record level: DP-SGD on
every client step, Poisson batches of expected size 16) against plain FedAvg with the same clients, batches and
rounds, for each ConvNet ``--widths`` and ``--local-epochs``. Each run is its own ``fedaudit train`` process, timed
from its start to its exit; the two runs of a pair follow each other, in turns (DP first in one pair, no DP first in
the next), and the ratio is taken pair by pair, so a drift of the machine's speed moves both sides of a pair alike.
The table gives each side's median, the median of the pairs' ratios and their range; only the median of the
pairs' ratios is the figure to quote (a shared 2-core machine moves single runs by 30%).

    python benchmarks/dp_price.py [--widths 32 128] [--local-epochs 1 5] [--pairs 3] [--clients 1000]
        [--rounds 20] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _machine import add_program_option, describe, fedaudit_command, use_program


def seconds_of(*args: str) -> float:
    """Wall seconds of ``fedaudit train ARGS`` in a process of its own with one torch thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    done = subprocess.run([*fedaudit_command(), "train", *args], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"fedaudit train {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def paired(dp: tuple[str, ...], plain: tuple[str, ...], pairs: int) -> tuple[list[float], list[float]]:
    """``pairs`` runs of each command, alternated and in turns; the times of the DP runs and of the plain ones."""
    with_dp, without = [], []
    for index in range(pairs):
        if index % 2 == 0:
            with_dp.append(seconds_of(*dp))
            without.append(seconds_of(*plain))
        else:
            without.append(seconds_of(*plain))
            with_dp.append(seconds_of(*dp))
    return with_dp, without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--local-epochs", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--pairs", type=int, default=3, help="alternated DP / no-DP pairs per setting")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--client-fraction", type=float, default=0.02)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds: digits, 20 clients, 2 rounds, width 8, 1 epoch, 1 pair"
    )
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    if args.smoke:
        args.widths, args.local_epochs, args.pairs, args.dataset = [8], [1], 1, "digits"
        args.clients, args.rounds, args.client_fraction = 20, 2, 0.2
    folder = Path(tempfile.mkdtemp(prefix="dp-price-"))
    print(describe("cpu", 1), flush=True)
    print(
        f"{args.dataset}, IID, {args.clients} clients, {args.client_fraction:g} a round, {args.rounds} rounds, "
        f"batch 16, evaluation every 10 rounds on 2,000 test records; DP-FedAvg sigma 1 against FedAvg; "
        f"{args.pairs} alternated pair(s) per setting; one process per run, one torch thread"
    )
    print(f"{'width':>5} {'epochs':>6} {'DP (s)':>8} {'no DP (s)':>10} {'DP/no DP':>8} {'pairs':>13}")
    for width in args.widths:
        for epochs in args.local_epochs:
            base = (
                *("--dataset", args.dataset, "--partition", "iid", "--num-clients", str(args.clients)),
                *("--client-fraction", str(args.client_fraction), "--batch-size", "16", "--width", str(width)),
                *("--local-epochs", str(epochs), "--rounds", str(args.rounds), "--eval-every", "10"),
                *("--eval-sample", "2000", "--device", "cpu", "--no-progress", "--overwrite"),
            )
            run = folder / f"{width}-{epochs}"
            dp = (*base, "--dp", "--noise-multiplier", "1", "--out", f"{run}-dp")
            plain = (*base, "--out", f"{run}-plain")
            with_dp, without = paired(dp, plain, args.pairs)
            ratios = sorted(a / b for a, b in zip(with_dp, without))
            spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
            print(
                f"{width:>5} {epochs:>6} {statistics.median(with_dp):>8.1f} {statistics.median(without):>10.1f} "
                f"{statistics.median(ratios):>8.2f} {spread:>13}",
                flush=True,
            )


if __name__ == "__main__":
    main()

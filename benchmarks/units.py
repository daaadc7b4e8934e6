"""Record-level against client-level DP on one cross-device federation: time and test accuracy at the same epsilons.

Fashion-MNIST split IID over K clients, a fraction of them each round (2%: 20 of 1,000), batch 16, fedaudit's five
local epochs, ConvNet width 32, one torch thread: trained without DP (the reference), with record-level DP-FedAvg
(DP-SGD on every client step; epsilon per record) and with client-level DP-FedAvg (each client's update clipped to
``--max-update-norm``, noise sigma C on their sum at the server, clients sampled by the server; epsilon per client),
sigma calibrated for each ``--epsilons`` target. The two epsilons protect different units, so the table compares
what each costs at the same number, not two guarantees of the same thing. Each run is its own process; the machine
line says where the figures come from.

    python benchmarks/units.py [--clients 1000] [--rounds 20] [--epsilons 2 4 8] [--max-update-norm 1] [--smoke]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _machine import add_program_option, describe, fedaudit_command, use_program


def train(*args: str) -> tuple[float, float]:
    """Seconds of ``fedaudit train ARGS`` in a process of its own, and the run's final test accuracy."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = args[args.index("--out") + 1]
    began = time.perf_counter()
    done = subprocess.run([*fedaudit_command(), "train", *args], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"fedaudit train {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with open(Path(out) / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return seconds, float(rows[-1]["test_accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--client-fraction", type=float, default=0.02)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    parser.add_argument("--max-update-norm", type=float, default=1.0, help="C of client-level DP")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="seconds: digits, 20 clients, 2 rounds, one epsilon")
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    if args.smoke:
        args.clients, args.rounds, args.client_fraction, args.local_epochs = 20, 2, 0.5, 1
        args.epsilons, args.dataset = [8.0], "digits"
    folder = Path(tempfile.mkdtemp(prefix="units-"))
    print(describe("cpu", 1), flush=True)
    print(
        f"{args.dataset}, IID, {args.clients} clients, {args.client_fraction:g} a round, {args.rounds} rounds, "
        f"batch 16, {args.local_epochs} local epoch(s), width 32, seed {args.seed}; client-level C = "
        f"{args.max_update_norm:g}; evaluation every 10 rounds on 2,000 test records and after the last"
    )
    base = (
        *("--dataset", args.dataset, "--partition", "iid", "--num-clients", str(args.clients)),
        *("--client-fraction", str(args.client_fraction), "--batch-size", "16", "--width", "32"),
        *("--local-epochs", str(args.local_epochs), "--rounds", str(args.rounds), "--seed", str(args.seed)),
        *("--eval-every", "10", "--eval-sample", "2000", "--device", "cpu", "--no-progress", "--overwrite"),
    )
    print(f"{'unit':>8} {'epsilon':>8} {'train (s)':>10} {'accuracy':>9}")
    seconds, accuracy = train(*base, "--out", str(folder / "no-dp"))
    print(f"{'no DP':>8} {'inf':>8} {seconds:>10.1f} {accuracy:>9.3f}", flush=True)
    levels = {
        "record": ("--dp",),
        "client": ("--dp", "--dp-level", "client", "--max-update-norm", str(args.max_update_norm)),
    }
    for epsilon in args.epsilons:
        for unit, options in levels.items():
            run = folder / f"{unit}-{epsilon:g}"
            seconds, accuracy = train(*base, *options, "--target-epsilon", str(epsilon), "--out", str(run))
            print(f"{unit:>8} {epsilon:>8g} {seconds:>10.1f} {accuracy:>9.3f}", flush=True)


if __name__ == "__main__":
    main()

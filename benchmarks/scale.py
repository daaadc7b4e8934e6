"""A cross-device federation on one machine: time per round, peak memory and the default attack's time, against the
number of clients (and rounds), with the test accuracy measured every round on the whole test split (the default)
and every ``--eval-every`` rounds on a sample of ``--eval-sample`` test records.

Fashion-MNIST split IID over K clients (about 60,000 / K records each), a fraction ``--client-fraction`` of them
each round, batch 16, DP-FedAvg at sigma 1 (a cross-device setting), fedaudit's five local epochs or
``--local-epochs``. Each run is its own process (``fedaudit train``, then ``fedaudit attack``), whose peak resident
memory it reports itself; one torch thread per process.

With ``--floor`` each setting is also trained without DP (plain FedAvg, the same clients, batches and rounds):
the time no DP query can go below, measured in the same run. ``--parallel-clients N`` runs N of a round's clients
at once (threads, one torch thread each).

    python benchmarks/scale.py [--clients 100 1000 3000] [--rounds 20 20 100] [--local-epochs 1] [--floor]
        [--parallel-clients 2] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import describe

# Runs fedaudit in this process and reports its peak resident memory (kB on Linux) on its last line.
_CHILD = (
    "import resource, sys\n"
    "from fedaudit.cli import main\n"
    "code = 0\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "except SystemExit as exc:\n"
    "    code = exc.code or 0\n"
    "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    "sys.exit(code)\n"
)


def fedaudit(*args: str) -> tuple[float, float, str]:
    """Seconds and peak RSS (MB) of ``fedaudit ARGS`` in a process of its own, and what it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"fedaudit {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rss = re.search(r"^MAXRSS (\d+)$", done.stdout, flags=re.MULTILINE)
    assert rss is not None
    return seconds, int(rss.group(1)) / 1024, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 3000])
    parser.add_argument("--rounds", type=int, nargs="+", default=[20, 20, 100], help="one per --clients")
    parser.add_argument("--client-fraction", type=float, default=0.02)
    parser.add_argument("--local-epochs", type=int, default=5, help="each client's epochs a round (fedaudit's default)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-sample", type=int, default=2000)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument(
        "--sampled-only", action="store_true", help="only the --eval-every/--eval-sample setting, not every round"
    )
    parser.add_argument("--floor", action="store_true", help="also train each setting without DP (the floor)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every figure is of this device)")
    parser.add_argument("--parallel-clients", type=int, default=1, help="clients trained at once (threads)")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits, 20 clients, 2 rounds of 1 local epoch, one setting (with its floor)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.rounds, args.dataset, args.client_fraction, args.local_epochs = [20], [2], "digits", 0.2, 1
        args.eval_every, args.eval_sample, args.floor = 2, 100, True
    if len(args.rounds) != len(args.clients):
        parser.error("give one --rounds per --clients")
    folder = Path(tempfile.mkdtemp(prefix="scale-")) if args.out is None else args.out
    print(describe(args.device, 1), flush=True)
    print(
        f"{args.dataset}, IID, client fraction {args.client_fraction}, batch 16, {args.local_epochs} local epoch(s), "
        "DP-FedAvg sigma 1; "
        f"1 torch thread per client, {args.parallel_clients} client(s) at once"
    )
    header = (
        f"{'clients':>8} {'rounds':>6} {'evaluation':>24} {'train (s)':>10} {'s/round':>8} {'peak RSS (MB)':>14} "
        f"{'attack (s)':>11} {'attack RSS (MB)':>16}" + (f" {'no DP (s)':>13} {'DP/no DP':>8}" if args.floor else "")
    )
    print(header)
    for clients, rounds in zip(args.clients, args.rounds):
        settings = [] if args.smoke or args.sampled_only else [("every round, whole test split", ())]
        settings.append(
            (
                f"every {args.eval_every}, {args.eval_sample} records",
                ("--eval-every", str(args.eval_every), "--eval-sample", str(args.eval_sample)),
            )
        )
        for label, extra in settings:
            run = folder / f"{clients}-{rounds}-{len(extra)}"
            train = (
                *("train", "--dataset", args.dataset, "--partition", "iid", "--num-clients", str(clients)),
                *("--client-fraction", str(args.client_fraction), "--batch-size", "16"),
                *("--local-epochs", str(args.local_epochs)),
                *("--rounds", str(rounds), "--device", args.device, "--no-progress"),
                *("--parallel-clients", str(args.parallel_clients), *extra),
            )
            seconds, rss, _ = fedaudit(*train, "--dp", "--noise-multiplier", "1", "--out", str(run), "--overwrite")
            attack_seconds, attack_rss, _ = fedaudit("attack", str(run), "--device", args.device, "--no-progress")
            floor = ""
            if args.floor:
                plain, _, _ = fedaudit(*train, "--out", f"{run}-no-dp", "--overwrite")
                floor = f" {plain:>13.1f} {seconds / plain:>8.2f}"
            print(
                f"{clients:>8} {rounds:>6} {label:>24} {seconds:>10.1f} {seconds / rounds:>8.2f} {rss:>14.0f} "
                f"{attack_seconds:>11.1f} {attack_rss:>16.0f}{floor}"
            )


if __name__ == "__main__":
    main()

"""How much of a client-level DP run's epsilon its canary clients prove, in one run (Andrew et al., ICLR 2024).

Digits split IID over K clients, DP-FedAvg at client level (each update clipped to C = 1, noise at the server, sigma
calibrated for ``--epsilon``), ``--canary-clients`` canary clients, trained and attacked with ``--method canary`` for
each seed, every client in every round (``--rounds``) and a tenth of them (``--sampled-rounds``: sampled at 10%,
a client takes part in a tenth of the rounds, and a canary never sampled in ten rounds, a third of them, is as
absent as an excluded one, which caps what one run can prove; a sampled deployment runs many more rounds). For each
run: the largest rigorous bound (95%, four bounds together) and the final model's two-Gaussian estimate, both over
the accountant's epsilon; the median over seeds.

    python benchmarks/client_canaries.py [--epsilon 8] [--canaries 1000] [--rounds 10] [--sampled-rounds 100]
                                         [--seeds 0 1 2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _machine import add_program_option, describe, fedaudit_command, use_program


def fedaudit(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*fedaudit_command(), *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"fedaudit {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def audited(run: Path) -> tuple[float, float, float]:
    """The largest bound of the two views, the final model's estimate, and the accountant's epsilon."""
    views = [json.loads((run / "attacks" / f"canary-clients-{v}" / "metrics.json").read_text()) for v in VIEWS]
    bound = max(view["epsilon_lower_bound"] for view in views)
    return bound, views[1]["canary_audit"]["estimate"]["epsilon"], views[0]["accountant_epsilon"]


VIEWS = ("all-iterates", "final-model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10, help="rounds with every client in every round")
    parser.add_argument("--sampled-rounds", type=int, default=100, help="rounds with 10%% of the clients a round")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--smoke", action="store_true", help="seconds: 40 canaries, 2 rounds, one seed")
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    if args.smoke:
        args.canaries, args.rounds, args.sampled_rounds, args.seeds = 40, 2, 2, [0]
    folder = Path(tempfile.mkdtemp(prefix="client-canaries-"))
    print(describe("cpu", 1), flush=True)
    print(
        f"digits, IID, {args.clients} clients, rounds of 1 local epoch, DP-FedAvg at client level, "
        f"C = 1, epsilon {args.epsilon:g} (RDP, delta 1e-5), {args.canaries} canary clients, seeds {args.seeds}; "
        f"{args.rounds} rounds of every client, {args.sampled_rounds} rounds of 10%"
    )
    print(
        f"{'sampling':>10} {'rounds':>6} {'seeds':>5} {'train+attack (s)':>17} {'bound/eps':>10} {'estimate/eps':>13}"
    )
    for fraction, rounds in ((1.0, args.rounds), (0.1, args.sampled_rounds)):
        bounds, estimates, began = [], [], time.perf_counter()
        for seed in args.seeds:
            run = folder / f"{fraction:g}-{seed}"
            fedaudit(
                *("train", "--dataset", "digits", "--partition", "iid", "--num-clients", str(args.clients)),
                *("--rounds", str(rounds), "--local-epochs", "1", "--seed", str(seed), "--no-progress"),
                *("--dp", "--dp-level", "client", "--max-update-norm", "1", "--target-epsilon", str(args.epsilon)),
                *("--client-fraction", str(fraction), "--canary-clients", str(args.canaries), "--out", str(run)),
            )
            fedaudit("attack", str(run), "--method", "canary", "--no-progress")
            bound, estimate, epsilon = audited(run)
            bounds.append(bound / epsilon)
            estimates.append(estimate / epsilon)
        seconds = (time.perf_counter() - began) / len(args.seeds)
        print(
            f"{fraction:>10g} {rounds:>6} {len(args.seeds):>5} {seconds:>17.1f} {statistics.median(bounds):>10.2f} "
            f"{statistics.median(estimates):>13.2f}   (bounds {', '.join(f'{b:.2f}' for b in bounds)}; estimates "
            f"{', '.join(f'{e:.2f}' for e in estimates)})",
            flush=True,
        )


if __name__ == "__main__":
    main()

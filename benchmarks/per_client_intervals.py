"""Per-client AUC intervals of a cross-device audit: one bootstrap per client (the previous code path) against
``bootstrap_groups`` (the clients of the same classes share their non-members' resamples), on synthetic scores.

K clients hold ``--members`` audited members each and are scored against the same ``--nonmembers`` non-members (an
IID federation: every client holds every class), with ``--resamples`` resamples, as ``fedaudit attack`` does.

    python benchmarks/per_client_intervals.py [--clients 100 1000] [--members 5] [--nonmembers 5000] [--smoke]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _machine import describe

from fedaudit.attacks.metrics import DEFAULT_RESAMPLES, Bootstrap, bootstrap, bootstrap_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--members", type=int, default=5, help="audited members per client")
    parser.add_argument("--nonmembers", type=int, default=5000)
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (seconds): 20 clients, 500 non-members")
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.nonmembers = [20], 500
    rng = np.random.default_rng(0)
    negatives = rng.normal(0, 1, args.nonmembers)
    print(describe("cpu"), flush=True)
    print(
        f"per-client AUC intervals: {args.members} members per client, {args.nonmembers} non-members shared, "
        f"{args.resamples} resamples, 1 process"
    )
    print(f"{'clients':>8} {'per client (s)':>15} {'shared (s)':>11} {'speed-up':>9} {'max |CI end diff|':>18}")
    for clients in args.clients:
        sets = [rng.normal(0.3, 1, args.members) for _ in range(clients)]
        began = time.perf_counter()
        old = [
            bootstrap(
                np.concatenate([np.ones(args.members), np.zeros(args.nonmembers)]).astype(int),
                np.concatenate([positives, negatives]),
                rng=np.random.default_rng(1),
                resamples=args.resamples,
            )
            for positives in sets
        ]
        per_client = time.perf_counter() - began
        began = time.perf_counter()
        new = bootstrap_groups(negatives, sets, rng=np.random.default_rng(1), resamples=args.resamples)
        shared = time.perf_counter() - began
        gap = max(
            float(np.abs(np.subtract(Bootstrap.interval(a.auc), Bootstrap.interval(b.auc))).max())
            for a, b in zip(old, new)
        )
        print(f"{clients:>8} {per_client:>15.2f} {shared:>11.2f} {per_client / shared:>9.1f} {gap:>18.3f}")


if __name__ == "__main__":
    main()

"""How long an attack's bootstrap takes: the previous draw of its resamples against fedaudit's.

Every attack result carries a 95% bootstrap interval of its AUC (1,000 resamples by default, members and non-members
resampled apart; attacks.metrics.bootstrap). Each resample is a vector of counts, how often each record was drawn.
The previous path drew those counts with numpy's ``Generator.multinomial(n, [1/n] * n)``, whose cost grows with n
per resample; fedaudit now draws the n indices of each resample and counts them (``resample_counts``), which gives
counts of the same distribution, Multinomial(n, 1/n) (tests/attacks/test_metrics.py). Both are timed alternately
on the same scores (median of the repeats after a warm-up of each), and the ratio previous / ours is printed with
the two intervals, which differ only by their draws.

    python benchmarks/bootstrap.py [--records 300 900 5000] [--resamples 1000] [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _machine import describe

from fedaudit.attacks.metrics import Bootstrap, bootstrap, weighted_auc

SEED = 20261128


def previous_bootstrap(member: np.ndarray, score: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """The previous path, as it was: multinomial counts per side, all resamples in one block."""
    positives, negatives = score[member == 1], score[member == 0]
    n1, n0 = positives.size, negatives.size
    w1 = rng.multinomial(n1, np.full(n1, 1.0 / n1), size=resamples)
    w0 = rng.multinomial(n0, np.full(n0, 1.0 / n0), size=resamples)
    return weighted_auc(positives, negatives, w1, w0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[300, 900, 5000], help="members (= non-members)")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (seconds): 100 records, 1 repeat")
    args = parser.parse_args()
    if args.smoke:
        args.records, args.repeats = [100], 1
    print(describe("cpu"), flush=True)
    print(f"{args.resamples} resamples, members = non-members, median of {args.repeats} after a warm-up")
    print(
        f"{'records':>7} {'previous (ms)':>13} {'ours (ms)':>9} {'previous/ours':>13}  previous interval  our interval"
    )
    for n in args.records:
        data = np.random.default_rng(SEED)
        member = np.concatenate([np.ones(n, dtype=int), np.zeros(n, dtype=int)])
        score = data.normal(size=2 * n) + 0.3 * member
        paths = {
            "previous": lambda: previous_bootstrap(member, score, np.random.default_rng(SEED), args.resamples),
            "ours": lambda: bootstrap(member, score, rng=np.random.default_rng(SEED), resamples=args.resamples).auc,
        }
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        aucs = {name: path() for name, path in paths.items()}  # the warm-up
        for _ in range(args.repeats):
            for name, path in paths.items():
                began = time.perf_counter()
                path()
                seconds[name].append(time.perf_counter() - began)
        previous, ours = (statistics.median(seconds[name]) for name in paths)
        (a, b), (c, d) = (Bootstrap.interval(aucs[name]) for name in paths)
        print(
            f"{n:>7} {previous * 1e3:>13.1f} {ours * 1e3:>9.1f} {previous / ours:>13.2f}  "
            f"[{a:.3f}, {b:.3f}]     [{c:.3f}, {d:.3f}]",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""What the RDP accountant costs: one noise multiplier and sampling rate's RDP curve, and a noise calibration.

fedaudit's RDP accountant is Opacus' analysis (Mironov et al. 2019) at Opacus' 142 orders. Its 90 fractional orders
are a series that Opacus sums one term per Python step; fedaudit sums the same terms with numpy
(``fedaudit.privacy.accounting._rdp_one_step``). Timed here on the same (sigma, q) pairs, alternating:

- opacus: Opacus' ``compute_rdp`` at the same orders (the previous code path);
- ours: fedaudit's curve, its cache cleared before each pair so that it is computed, not looked up.

Then a calibration as ``--target-epsilon`` runs it (a root search over sigma, each step a new curve) timed with
the previous path patched in and with ours. Each line gives the median over its repeats and the ratio
previous/ours; the largest relative difference of the curves is printed too (the test suite checks 1e-9).

    python benchmarks/accounting.py [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from unittest import mock

import numpy as np
from _machine import describe

from fedaudit.privacy import accounting
from fedaudit.privacy.accounting import RDP_ORDERS, calibrate_noise_multiplier

PAIRS = ((0.7, 0.01), (1.0, 0.0256), (1.0, 0.1), (1.5, 0.06), (3.0, 0.3), (0.5, 0.5))


def opacus_curve(sigma: float, q: float) -> np.ndarray:
    """The previous path: Opacus' own compute_rdp at fedaudit's orders."""
    rdp = accounting._opacus_rdp().compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(RDP_ORDERS))
    return np.asarray(rdp, dtype=np.float64)


def ours_curve(sigma: float, q: float) -> np.ndarray:
    """fedaudit's curve, computed afresh."""
    accounting._rdp_one_step.cache_clear()
    return accounting._rdp_one_step(sigma, q)


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def calibrate(previous: bool) -> float:
    """One calibration of sigma for epsilon 8 over 300 steps at q = 0.05, on the previous path or ours."""
    accounting._rdp_one_step.cache_clear()
    accounting._epsilon_cached.cache_clear()
    settings = {"target_epsilon": 8.0, "sample_rate": 0.05, "queries_per_round": 30, "rounds": 10, "delta": 1e-5}
    if not previous:
        return calibrate_noise_multiplier(**settings)
    with mock.patch.object(accounting, "_rdp_one_step", opacus_curve):
        return calibrate_noise_multiplier(**settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timings of each path per line [default: 5]")
    parser.add_argument("--smoke", action="store_true", help="one (sigma, q) pair, one repeat")
    args = parser.parse_args()
    pairs, repeats = (PAIRS[:1], 1) if args.smoke else (PAIRS, args.repeats)
    print(describe(threads=1))
    print(f"{'sigma':>6} {'q':>7} {'opacus (ms)':>12} {'ours (ms)':>10} {'previous/ours':>14} {'max rel. diff':>14}")
    for sigma, q in pairs:
        ours_curve(sigma, q)  # warm-up: scipy's first calls
        previous, ours = [], []
        for _ in range(repeats):
            previous.append(timed(lambda: opacus_curve(sigma, q)))
            ours.append(timed(lambda: ours_curve(sigma, q)))
        reference, mine = opacus_curve(sigma, q), ours_curve(sigma, q)
        difference = float(np.max(np.abs(mine - reference) / np.maximum(np.abs(reference), 1e-300)))
        old, new = statistics.median(previous), statistics.median(ours)
        print(f"{sigma:>6g} {q:>7g} {1000 * old:>12.1f} {1000 * new:>10.1f} {old / new:>14.1f} {difference:>14.1e}")
    if not args.smoke:
        times = {True: [], False: []}
        sigmas = {}
        for _ in range(repeats):
            for previous in (True, False):
                start = time.perf_counter()
                sigmas[previous] = calibrate(previous)
                times[previous].append(time.perf_counter() - start)
        old, new = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"calibration (epsilon 8, q 0.05, 300 steps): previous {old:.2f} s (sigma {sigmas[True]:.6f}), "
            f"ours {new:.3f} s (sigma {sigmas[False]:.6f}), previous/ours {old / new:.1f}"
        )


if __name__ == "__main__":
    main()

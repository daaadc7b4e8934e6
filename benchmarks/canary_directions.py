"""How long a canary run spends drawing its canaries' directions: the previous path against fedaudit's.

Every round, each client of a run with gradient canaries projects its released sums on the directions of its canaries,
each direction drawn from its own stream (run seed, CANARY, canary) so that every engine and the audit draw the same one
(fedaudit.instruments.canaries.canary_rows). The previous path made a generator and derived its seed with numpy's
SeedSequence for every canary, then split the rows by parameter and joined them again; fedaudit now derives every
canary's seed at once (the same hash on arrays) and reseeds one generator. Both are timed alternately on the same
canaries of a ConvNet's parameters (median of the repeats after a warm-up of each), the directions are checked equal bit
for bit, and the ratio previous / ours is printed.

    python benchmarks/canary_directions.py [--canaries 1000] [--widths 16 32] [--layout parts] [--repeats 5]
                                           [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from _machine import describe

from fedaudit.instruments.canaries import LAYOUTS, canary_groups, canary_rows, group_of
from fedaudit.models import ModelSpec, build_model
from fedaudit.seeding import Stream, make_generator

SEED = 20261127


def previous_rows(seed: int, indices: np.ndarray, shapes: dict[str, torch.Size], layout: str) -> torch.Tensor:
    """The previous path, as it was: a generator and a SeedSequence per canary, the rows split by parameter, then
    joined again by the query log."""
    total = sum(int(torch.Size(shape).numel()) for shape in shapes.values())
    groups = canary_groups(list(shapes)) if layout == "parts" else ()
    masks: dict[str, torch.Tensor] = {}
    rows = torch.empty(len(indices), total)
    for row, i in enumerate(indices):
        direction = torch.randn(total, generator=make_generator(seed, Stream.CANARY, int(i)))
        if groups:
            group = group_of(int(i), groups)
            if group.name not in masks:
                masks[group.name] = torch.cat(
                    [torch.full((int(torch.Size(s).numel()),), name in group.members) for name, s in shapes.items()]
                )
            direction = direction * masks[group.name]
        rows[row] = direction / direction.norm()
    split, start = {}, 0
    for name, shape in shapes.items():
        size = int(torch.Size(shape).numel())
        split[name] = rows[:, start : start + size].reshape(len(indices), *shape)
        start += size
    return torch.cat([split[name].reshape(len(indices), -1) for name in shapes], dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=1000, help="canaries of one client")
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 32], help="ConvNet widths (Fashion-MNIST)")
    parser.add_argument("--layout", choices=LAYOUTS, default="parts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (seconds): 50 canaries, width 8")
    args = parser.parse_args()
    if args.smoke:
        args.canaries, args.widths, args.repeats = 50, [8], 1
    torch.set_num_threads(args.threads)
    print(describe("cpu"), flush=True)
    print(f"{args.canaries} canaries of one client, layout {args.layout}, median of {args.repeats} after a warm-up")
    print(f"{'width':>5} {'params':>7} {'previous (s)':>12} {'ours (s)':>9} {'previous/ours':>13}  equal")
    indices = np.arange(args.canaries, dtype=np.int64)
    for width in args.widths:
        model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width, 3))
        shapes = {name: p.shape for name, p in model.named_parameters()}
        paths = {
            "previous": lambda: previous_rows(SEED, indices, shapes, args.layout),
            "ours": lambda: canary_rows(SEED, indices, shapes, args.layout),
        }
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        made: dict[str, torch.Tensor] = {}
        for repeat in range(args.repeats + 1):
            for name, path in paths.items():
                start = time.perf_counter()
                made[name] = path()
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
        previous, ours = (statistics.median(seconds[name]) for name in paths)
        params = sum(int(torch.Size(s).numel()) for s in shapes.values())
        equal = torch.equal(made["previous"], made["ours"])
        print(f"{width:>5} {params:>7} {previous:>12.3f} {ours:>9.3f} {previous / ours:>13.2f}  {equal}")


if __name__ == "__main__":
    main()

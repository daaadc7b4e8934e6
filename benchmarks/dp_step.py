"""The DP step where users run it: a client's Poisson batches of a few dozen records, the model updated after every
step, against the plain step on the same batches; and where the extra time goes.

A client of the thousand-client federation holds about 54 training records; DP-FedAvg's step draws a Poisson batch
of expected size 16 from them (a fresh source per query, as the client's secret keys one), and SGD updates the model
after each step. ``benchmarks/per_sample_grads.py`` times one batch again and again, whose caches stay warm; here
each step is a new batch on a new point, as in a run. In one process, in blocks of steps alternated between the
variants (each block of one variant after another, the order reversed every block, so that a drift of the machine's
speed moves them alike), each variant on the same model and the same kind of batches:

- ``plain``: the mean loss's forward and ``.backward()`` (what no DP step can go below);
- ``trace``: the forward and the backward to the layer outputs that the DP step takes (no weight gradients);
- ``norms``: that and every example's gradient norm (per-sample weight gradients where they are kept);
- ``clipped``: that and the clipped sum;
- ``ours``: the DP step (``dp_gradient``: the clipped sum, the noise, the division).

The differences between neighbouring columns are what each part costs; ``plain`` minus ``trace`` is what the plain
step's weight gradients cost, to compare with ``norms`` minus ``trace``.

Times are per 16 rows (each step's time scaled by 16 over its batch size), the mean of the steps after the first
two blocks. The machine's page faults move a harness like this one by 30% (a step freshly faults in what the
allocator gave back), so its allocator is told to keep what it has (``_machine.keep_allocated_memory``: set before
the process's first allocation, by running the script again).

    python benchmarks/dp_step.py [--widths 32 128] [--blocks 24] [--steps 12] [--records 54] [--batch 16]
        [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _machine import describe, keep_allocated_memory

keep_allocated_memory()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedaudit.models import ConvNet  # noqa: E402
from fedaudit.privacy import layers  # noqa: E402
from fedaudit.privacy import primitive as dp  # noqa: E402
from fedaudit.privacy.randomness import keyed_generator  # noqa: E402

VARIANTS = ("plain", "trace", "norms", "clipped", "ours")


def variants(model: torch.nn.Module, clip: float, batch: int) -> dict:
    """Each variant: (inputs, labels, the query's source) -> a gradient by parameter name."""

    def plain(x, y, source):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        return {name: p.grad for name, p in model.named_parameters()}

    def zeros(params):
        return {name: torch.zeros_like(p) for name, p in params.items()}

    def trace(x, y, source):
        params = dp.trainable_params(model)
        layers.trace_layers(model, x, y, params, F.cross_entropy)
        return zeros(params)

    def norms(x, y, source):
        params = dp.trainable_params(model)
        dp._layer_squares(model, x, y, params, F.cross_entropy, for_sum=True)
        return zeros(params)

    def clipped(x, y, source):
        return dp.clipped_sum(model, x, y, clip)[0]

    def ours(x, y, source):
        return dp.dp_gradient(
            model, x, y, noise_multiplier=1.0, max_grad_norm=clip, expected_batch_size=batch, generator=source
        ).grads

    return {"plain": plain, "trace": trace, "norms": norms, "clipped": clipped, "ours": ours}


def measure(width: int, blocks: int, steps: int, records: int, batch: int) -> dict[str, float]:
    """Mean ms per 16 rows of each variant, alternated in blocks of ``steps`` steps."""
    torch.manual_seed(0)
    model = ConvNet((1, 28, 28), 10, width=width)
    x_all, y_all = torch.randn(records, 1, 28, 28), torch.randint(0, 10, (records,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = variants(model, clip=0.1, batch=batch)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    query = 0
    for block in range(blocks):
        order = VARIANTS if block % 2 == 0 else VARIANTS[::-1]
        for name in order:
            for _ in range(steps):
                query += 1
                source = keyed_generator(query.to_bytes(8, "big") * 4)
                idx = dp.poisson_sample(records, batch / records, generator=source)
                began = time.perf_counter()
                grads = run[name](x_all[idx], y_all[idx], source)
                for key, p in model.named_parameters():
                    p.grad = grads[key]
                optimizer.step()
                if block >= min(2, blocks - 1) and len(idx):
                    times[name].append((time.perf_counter() - began) * 16 / len(idx))
    return {name: 1e3 * statistics.mean(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--steps", type=int, default=12, help="steps of one variant in a block")
    parser.add_argument("--records", type=int, default=54, help="the client's records")
    parser.add_argument("--batch", type=int, default=16, help="the expected Poisson batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="width 8, 3 blocks of 2 steps (seconds)")
    args = parser.parse_args()
    if args.smoke:
        args.widths, args.blocks, args.steps = [8], 3, 2
    torch.set_num_threads(args.threads)
    print(describe("cpu"))
    print(
        f"a client's {args.records} records, Poisson batches of expected size {args.batch}, the model updated every "
        f"step; {args.blocks} alternated blocks of {args.steps} steps; ms per 16 rows"
    )
    header = [*VARIANTS, "norms-trace", "plain-trace", "ours/plain"]
    print(f"{'width':>5} " + " ".join(f"{name:>13}" for name in header))
    for width in args.widths:
        ms = measure(width, args.blocks, args.steps, args.records, args.batch)
        cells = [f"{ms[name]:13.2f}" for name in VARIANTS]
        cells += [f"{ms['norms'] - ms['trace']:13.2f}", f"{ms['plain'] - ms['trace']:13.2f}"]
        cells.append(f"{ms['ours'] / ms['plain']:13.3f}")
        print(f"{width:>5} " + " ".join(cells))


if __name__ == "__main__":
    main()

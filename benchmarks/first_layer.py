"""A first convolution's per-sample weight gradients on the CPU: a grouped convolution with the examples as groups
(the previous path) against one batched product of the layer's patches and output gradients (fedaudit's path for
convolutions of at most ``PATCH_INPUTS`` inputs an output: 1 to 4 channels, 3x3), on the layer alone and in the DP
step where a client runs it.

The layer alone: one convolution of 1, 3, 4 or 8 input channels (28x28, or 32x32 for three) at widths 32 and 128,
batches of 16 and 256, chunked as the DP step chunks it; the median of ``--repeats`` timings, the two paths in turns.
The DP step: ``dp_step.py``'s setting (a client's 54 records, Poisson batches of expected size 16, the model updated
every step), the ConvNet on 28x28 with the rule off (``PATCH_INPUTS`` 0: every convolution grouped) and on, in
alternated blocks; the thread's CPU time per 16 rows (a shared machine's steal and its other processes move wall
time by more than the difference), and the median of the blocks' ratios. "previous/ours" above 1 means the patches'
product is faster.

    python benchmarks/first_layer.py [--widths 32 128] [--batches 16 256] [--repeats 5] [--blocks 60] [--steps 4]
        [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _machine import describe, keep_allocated_memory

keep_allocated_memory()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fedaudit.models import ConvNet  # noqa: E402
from fedaudit.privacy import layers  # noqa: E402
from fedaudit.privacy import primitive as dp  # noqa: E402
from fedaudit.privacy.randomness import keyed_generator  # noqa: E402

LAYERS = ((1, 28), (3, 32), (4, 28), (8, 28))
"""(input channels, image side) of the first convolutions timed alone."""


def per_sample(conv: nn.Conv2d, a: torch.Tensor, b: torch.Tensor, patch_inputs: int) -> torch.Tensor:
    """The per-sample weight gradients in the DP step's chunks, with ``PATCH_INPUTS`` set to ``patch_inputs``."""
    layers.PATCH_INPUTS = patch_inputs
    chunk = layers._grouped_chunk(conv, a)
    parts = [
        layers._per_sample_conv2d_weight(conv, a[s : s + chunk], b[s : s + chunk]) for s in range(0, len(a), chunk)
    ]
    return torch.cat(parts)


def layer_alone(channels: int, side: int, width: int, batch: int, repeats: int, default: int) -> tuple[float, float]:
    """Median ms of the grouped path and of the patches' product for one layer; both checked to agree."""
    conv = nn.Conv2d(channels, width, kernel_size=3, padding=1)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(batch, channels, side, side, generator=generator)
    b = torch.randn(batch, width, side, side, generator=generator)
    torch.testing.assert_close(per_sample(conv, a, b, 0), per_sample(conv, a, b, 10**9), rtol=1e-4, atol=1e-3)
    count = max(2, int(0.2 / max(_seconds(lambda: per_sample(conv, a, b, 0), 1), 1e-4)))
    times: dict[int, list[float]] = {0: [], 10**9: []}
    for _ in range(repeats):
        for rule in times:
            times[rule].append(1e3 * _seconds(lambda: per_sample(conv, a, b, rule), count))
    layers.PATCH_INPUTS = default
    return statistics.median(times[0]), statistics.median(times[10**9])


def in_the_step(width: int, blocks: int, steps: int, default: int) -> tuple[float, float, float]:
    """Mean CPU ms per 16 rows of the DP step with every convolution grouped and with the rule, alternated in blocks,
    and the median over blocks of the one's time over the other's."""
    torch.manual_seed(0)
    records, batch = 54, 16
    model = ConvNet((1, 28, 28), 10, width=width)
    x_all, y_all = torch.randn(records, 1, 28, 28), torch.randint(0, 10, (records,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    times: dict[int, list[float]] = {0: [], default: []}
    means: dict[int, list[float]] = {0: [], default: []}
    query = 0
    for block in range(blocks):
        for rule in list(times) if block % 2 == 0 else list(times)[::-1]:
            layers.PATCH_INPUTS = rule
            block_times = []
            for _ in range(steps):
                query += 1
                source = keyed_generator(query.to_bytes(8, "big") * 4)
                idx = dp.poisson_sample(records, batch / records, generator=source)
                began = time.thread_time()
                result = dp.dp_gradient(
                    model, x_all[idx], y_all[idx], noise_multiplier=1.0, max_grad_norm=0.1,
                    expected_batch_size=batch, generator=source,
                )  # fmt: skip
                for name, p in model.named_parameters():
                    p.grad = result.grads[name]
                optimizer.step()
                if block >= min(2, blocks - 1) and len(idx):
                    block_times.append((time.thread_time() - began) * 16 / len(idx))
            times[rule] += block_times
            if block_times:
                means[rule].append(statistics.mean(block_times))
    layers.PATCH_INPUTS = default
    ratio = statistics.median(a / b for a, b in zip(means[0], means[default]))
    return 1e3 * statistics.mean(times[0]), 1e3 * statistics.mean(times[default]), ratio


def _seconds(step, count: int) -> float:
    began = time.perf_counter()
    for _ in range(count):
        step()
    return (time.perf_counter() - began) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=60, help="alternated blocks of DP steps")
    parser.add_argument("--steps", type=int, default=4, help="DP steps of one rule in a block")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="width 8, batch 8, one repeat, 2 blocks of 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.widths, args.batches, args.repeats, args.blocks, args.steps = [8], [8], 1, 2, 2
    torch.set_num_threads(args.threads)
    default = layers.PATCH_INPUTS
    print(describe("cpu"), flush=True)
    print(f"the layer alone (PATCH_INPUTS {default}: the rule takes the product up to {default} inputs an output)")
    print(f"{'channels':>8} {'side':>4} {'width':>5} {'batch':>5} {'grouped (ms)':>12} {'patches (ms)':>12} "
          f"{'previous/ours':>13}")  # fmt: skip
    for channels, side in LAYERS:
        for width in args.widths:
            for batch in args.batches:
                grouped, patches = layer_alone(channels, side, width, batch, args.repeats, default)
                print(f"{channels:>8} {side:>4} {width:>5} {batch:>5} {grouped:>12.3f} {patches:>12.3f} "
                      f"{grouped / patches:>13.2f}", flush=True)  # fmt: skip
    print(f"the DP step: a client's 54 records, Poisson batches of expected size 16; {args.blocks} alternated blocks "
          f"of {args.steps} steps; CPU ms per 16 rows")  # fmt: skip
    print(f"{'width':>5} {'all grouped':>11} {'ours':>8} {'previous/ours':>13} {'median of blocks':>16}")
    for width in args.widths:
        grouped, ours, ratio = in_the_step(width, args.blocks, args.steps, default)
        print(f"{width:>5} {grouped:>11.2f} {ours:>8.2f} {grouped / ours:>13.2f} {ratio:>16.2f}", flush=True)


if __name__ == "__main__":
    main()

"""The ConvNet's average pooling on the CPU: ATen's avg_pool2d (the previous path) against fedaudit's AvgPool2x2 (a
depthwise convolution with weights 1/4, the same floats), in the plain step (forward and backward of the mean loss)
and in the DP step (``dp_gradient``: per-sample norms, clipped sum, noise), at each width and batch size.

Both models are built from one seed and differ only in their pooling modules; the four steps are timed in turns, so
that a drift of the machine's speed moves all of them alike, and each figure is the median of ``--repeats`` rounds
of ``--steps`` steps. "previous/ours" above 1 means the new pooling is faster; the two DP-over-plain columns are
what DP costs a step with each pooling (a faster plain step raises it: the DP step's own work is unchanged).

    python benchmarks/pooling.py [--widths 32 128] [--batches 16 256] [--threads 1] [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _machine import describe
from torch import nn

from fedaudit.models import AvgPool2x2, ModelSpec, build_model
from fedaudit.privacy.primitive import dp_gradient


def twin_models(width: int) -> tuple[nn.Module, nn.Module]:
    """The ConvNet (28x28 input, depth 3) with ATen's pooling, and the same weights with fedaudit's."""
    spec = ModelSpec("convnet", (1, 28, 28), 10, width=width, depth=3)
    ours = build_model(spec)
    previous = build_model(spec)
    previous.load_state_dict(ours.state_dict())
    for index, module in enumerate(previous.features):
        if isinstance(module, AvgPool2x2):
            previous.features[index] = nn.AvgPool2d(kernel_size=2, stride=2)
    return previous, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="steps per timing (default: about 0.5 s of steps)")
    parser.add_argument("--smoke", action="store_true", help="width 8, batch 8, one repeat of two steps")
    args = parser.parse_args()
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # huge pages, as `import fedaudit` gives its users
    if args.smoke:
        args.widths, args.batches, args.repeats, args.steps = [8], [8], 1, 2
    torch.set_num_threads(args.threads)
    print(describe("cpu"), flush=True)
    print(
        f"{'width':>5} {'batch':>5} {'plain prev (ms)':>15} {'plain ours (ms)':>15} {'DP prev (ms)':>12} "
        f"{'DP ours (ms)':>12} {'plain previous/ours':>19} {'DP previous/ours':>16} {'DP/plain prev':>13} "
        f"{'DP/plain ours':>13}"
    )
    for width in args.widths:
        for batch in args.batches:
            previous, ours = twin_models(width)
            x = torch.randn(batch, 1, 28, 28, generator=torch.Generator().manual_seed(0))
            y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))
            noise = torch.Generator().manual_seed(2)

            def plain(model: nn.Module) -> None:
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()

            def dp(model: nn.Module) -> None:
                dp_gradient(
                    model, x, y, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=batch, generator=noise
                )

            sides = {
                "plain prev": lambda: plain(previous),
                "plain ours": lambda: plain(ours),
                "dp prev": lambda: dp(previous),
                "dp ours": lambda: dp(ours),
            }
            for step in sides.values():  # warm-up
                step()
            steps = args.steps or max(2, int(0.5 / max(_seconds(sides["dp prev"], 1), 1e-4)))
            times: dict[str, list[float]] = {key: [] for key in sides}
            for _ in range(args.repeats):
                for key, step in sides.items():
                    times[key].append(_seconds(step, steps) * 1e3)
            med = {key: statistics.median(values) for key, values in times.items()}
            print(
                f"{width:>5} {batch:>5} {med['plain prev']:>15.2f} {med['plain ours']:>15.2f} {med['dp prev']:>12.2f} "
                f"{med['dp ours']:>12.2f} {med['plain prev'] / med['plain ours']:>19.2f} "
                f"{med['dp prev'] / med['dp ours']:>16.2f} {med['dp prev'] / med['plain prev']:>13.2f} "
                f"{med['dp ours'] / med['plain ours']:>13.2f}",
                flush=True,
            )


def _seconds(step, count: int) -> float:
    """Seconds per call of ``step`` over ``count`` calls."""
    began = time.perf_counter()
    for _ in range(count):
        step()
    return (time.perf_counter() - began) / count


if __name__ == "__main__":
    main()

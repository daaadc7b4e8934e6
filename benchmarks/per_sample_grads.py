"""Per-sample gradient throughput: fedaudit's DP primitive vs Opacus' GradSampleModule (hooks).

Both sides compute the per-sample gradients of a batch of 256 28x28 images on the
paper's ConvNet at widths 32 and 128, measured alternately in the same run; the
ratio (Opacus time / our time, > 1 means we are faster) is what to compare across
machines. "ours: grads" is per_sample_gradients alone (what Opacus' hooks
produce), "ours: DP step" adds clipping, summing and noise (what a DP-SGD step
needs; Opacus' optimizer does that on top of its grad samples).

    python benchmarks/per_sample_grads.py [--threads 1] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from twins import convnet_and_opacus_twin

from fedaudit.privacy.primitive import dp_gradient, per_sample_gradients


def _time(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message="Full backward hook")
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, device={device}, batch={args.batch}, "
        "input 1x28x28"
    )
    print(
        f"{'width':>5} {'ours: grads (s)':>16} {'ours: DP step (s)':>18} {'opacus (s)':>11} "
        f"{'ratio grads':>12} {'ratio DP step':>14}"
    )
    for width in args.widths:
        model, gsm = convnet_and_opacus_twin(width, device)
        x = torch.randn(args.batch, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (args.batch,), device=device)
        generator = torch.Generator(device=device).manual_seed(0)

        def ours_grads() -> None:
            per_sample_gradients(model, x, y)

        def ours_dp() -> None:
            dp_gradient(
                model,
                x,
                y,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                expected_batch_size=args.batch,
                generator=generator,
            )

        def opacus() -> None:
            gsm.zero_grad(set_to_none=True)
            for p in gsm.parameters():
                p.grad_sample = None
            F.cross_entropy(gsm(x), y, reduction="sum").backward()

        for fn in (ours_grads, ours_dp, opacus):  # warm-up
            fn()
        times: dict[str, list[float]] = {"grads": [], "dp": [], "opacus": []}
        for _ in range(args.repeats):  # alternate so background load hits all three alike
            times["grads"].append(_time(ours_grads, device))
            times["dp"].append(_time(ours_dp, device))
            times["opacus"].append(_time(opacus, device))
        med = {key: statistics.median(values) for key, values in times.items()}
        print(
            f"{width:>5} {med['grads']:>16.3f} {med['dp']:>18.3f} {med['opacus']:>11.3f} "
            f"{med['opacus'] / med['grads']:>12.2f} {med['opacus'] / med['dp']:>14.2f}"
        )
        gsm._close()


if __name__ == "__main__":
    main()

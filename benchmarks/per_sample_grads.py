"""DP step throughput: fedaudit's DP primitive vs its previous code path, Opacus' GradSampleModule (hooks) and Opacus'
fastest mode, fast gradient clipping (GradSampleModuleFastGradientClipping, with and without ghost clipping).

All sides work on a batch of 256 28x28 images on the paper's ConvNet at widths 32 and 128, measured alternately in
the same run; the ratios (their time / our time, > 1 means we are faster) are what to compare across machines.
"plain" is the same model's forward and backward of the batch without DP (the mean loss, ``.backward()``): what no DP
step can go below; "ours/plain" is what DP costs a step.
"ours" is ``dp_gradient`` (layer-wise norms and clipped sum, noise); "previous" is the code path it replaced
(torch.func per-sample gradients of the whole model, clip_and_sum, the same noise); "GSM" is Opacus' hooks
producing every grad sample (before its optimizer clips and sums them, so a lower bound on its DP step). Opacus'
fast gradient clipping gives the clipped sum directly (two backward passes), like our DP step.

Peak memory (CPU, Linux): each DP step runs in a fresh process after one warm-up step; the peak resident set size
is reset just before the measured step (/proc/self/clear_refs), and its growth over the size before the step is
printed (``--memory``).

    python benchmarks/per_sample_grads.py [--threads 1] [--repeats 5] [--device cpu] [--memory] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from _machine import describe
from twins import convnet_and_opacus_twin

from fedaudit.privacy.primitive import add_noise, clip_and_sum, dp_gradient, per_sample_gradients


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
    parser.add_argument("--memory", action="store_true", help="also measure each DP step's peak memory (CPU)")
    parser.add_argument("--child", choices=["ours", "previous", "fgc", "ghost"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): a batch of 8, width 8, 1 repeat (with --memory: 4 child processes, about 3 s "
        "each)",
    )
    args = parser.parse_args()
    # Huge pages for tensors of 2 MB and more, as `import fedaudit` gives its users (this script imports torch first;
    # torch reads the setting at its first allocation): without them the large batch's activations cost a page
    # fault per 4 kB on every step, on every side alike (docs/performance.md). THP_MEM_ALLOC_ENABLE=0 turns them off.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if args.smoke:
        args.batch, args.widths, args.repeats = 8, [8], 1
    torch.set_num_threads(args.threads)
    if args.child:
        warnings.filterwarnings("ignore")
        _child(args.child, args.widths[0], args.batch)
        return
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message="Full backward hook")
    print(describe(device), flush=True)
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, device={device}, batch={args.batch}, "
        f"input 1x28x28, THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']}"
    )
    print(
        f"{'width':>5} {'plain (s)':>9} {'ours (s)':>9} {'previous (s)':>13} {'GSM (s)':>8} {'fgc (s)':>8} "
        f"{'ghost (s)':>9} {'ours/plain':>10} {'previous/ours':>14} {'GSM/ours':>9} {'fastest fgc/ghost / ours':>25}"
    )
    for width in args.widths:
        model, gsm = convnet_and_opacus_twin(width, device)
        x = torch.randn(args.batch, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (args.batch,), device=device)
        generator = torch.Generator(device=device).manual_seed(0)

        def plain() -> None:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()

        def ours() -> None:
            dp_step(model, x, y, generator, previous=False)

        def previous() -> None:
            dp_step(model, x, y, generator, previous=True)

        def opacus() -> None:
            gsm.zero_grad(set_to_none=True)
            for p in gsm.parameters():
                p.grad_sample = None
            F.cross_entropy(gsm(x), y, reduction="sum").backward()

        def opacus_release() -> None:
            """Drop the grad samples (300 MB at width 128) after the timed step: left alive, they change what the
            allocator hands the next side (our step took 0.74 s after them instead of 0.55 s, plain's 0.45 s)."""
            for p in gsm.parameters():
                p.grad_sample = None

        fast = {ghost: fast_clipping_step(width, device, x, y, ghost=ghost) for ghost in (False, True)}
        steps = {
            "plain": plain,
            "ours": ours,
            "previous": previous,
            "opacus": opacus,
            "fgc": fast[False],
            "ghost": fast[True],
        }
        after = {"opacus": opacus_release}  # untimed, so that no side's leftovers weigh on the next
        for key, fn in steps.items():  # warm-up
            fn()
            after.get(key, lambda: None)()
        times: dict[str, list[float]] = {key: [] for key in steps}
        for _ in range(args.repeats):  # alternate so background load hits all of them alike
            for key, fn in steps.items():
                times[key].append(_time(fn, device))
                after.get(key, lambda: None)()
        med = {key: statistics.median(values) for key, values in times.items()}
        fastest = min(med["fgc"], med["ghost"])
        print(
            f"{width:>5} {med['plain']:>9.3f} {med['ours']:>9.3f} {med['previous']:>13.3f} {med['opacus']:>8.3f} "
            f"{med['fgc']:>8.3f} {med['ghost']:>9.3f} {med['ours'] / med['plain']:>10.2f} "
            f"{med['previous'] / med['ours']:>14.2f} {med['opacus'] / med['ours']:>9.2f} {fastest / med['ours']:>25.2f}"
        )
        gsm._close()
    if args.memory and device.type == "cpu":
        print(f"{'width':>5} {'ours (MB)':>10} {'previous (MB)':>14} {'opacus fgc (MB)':>16} {'opacus ghost (MB)':>18}")
        for width in args.widths:
            sizes = [_peak_growth(kind, width, args) for kind in ("ours", "previous", "fgc", "ghost")]
            print(f"{width:>5} {sizes[0]:>10.0f} {sizes[1]:>14.0f} {sizes[2]:>16.0f} {sizes[3]:>18.0f}")


def dp_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator, *, previous: bool):
    """One DP query with sigma = 1, C = 1: fedaudit's primitive, or the code path it replaced."""
    if not previous:
        dp_gradient(
            model, x, y, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=len(y), generator=generator
        )
        return
    summed, _ = clip_and_sum(per_sample_gradients(model, x, y), 1.0)
    add_noise(summed, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=len(y), generator=generator)


def fast_clipping_step(width: int, device: torch.device, x: torch.Tensor, y: torch.Tensor, *, ghost: bool):
    """One clipped-sum step of Opacus' fast gradient clipping (noise 0: the noise is the same work on both sides)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model, _ = convnet_and_opacus_twin(width, device)
    module = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=ghost)
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(module.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=256
    )
    criterion = DPLossFastGradientClipping(module, optimizer, torch.nn.CrossEntropyLoss(reduction="mean"))

    def step() -> None:
        optimizer.zero_grad()
        criterion(module(x), y).backward()

    return step


def _peak_growth(kind: str, width: int, args: argparse.Namespace) -> float:
    """MB by which one DP step (after a warm-up step) raises the peak resident set size of a fresh process."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--widths", str(width), "--batch", str(args.batch),
         "--threads", str(args.threads)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


def _child(kind: str, width: int, batch: int) -> None:
    """Run one DP step of ``kind`` and print the growth of the maximum RSS over the RSS before it, in MB."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    if kind in ("ours", "previous"):
        model, _ = convnet_and_opacus_twin(width, device)
        generator = torch.Generator().manual_seed(0)

        def step() -> None:
            dp_step(model, x, y, generator, previous=kind == "previous")
    else:
        step = fast_clipping_step(width, device, x, y, ghost=kind == "ghost")
    step()  # warm-up: lazy initialisation is not the step's memory
    before = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:  # reset the peak (VmHWM) to the current RSS (Linux >= 4.0)
        refs.write("5")
    step()
    print(max(0.0, _status_mb("VmHWM") - before))


def _status_mb(key: str) -> float:
    """A size from /proc/self/status (VmRSS: now, VmHWM: the peak since the last reset), in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


if __name__ == "__main__":
    main()

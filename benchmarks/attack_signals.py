"""Gradient-norm signal throughput: the white-box attack's signal from fedaudit's primitive vs its previous code path
and Opacus' GradSampleModule.

All sides compute the L2 norm of every example's loss gradient (all parameters,
no clipping) for the same examples on the paper's ConvNet (28x28 input, depth 3)
at widths 32 and 128, in batches, in the same run. "ours" is
``fedaudit.attacks.membership.signals.compute_signals(..., ["grad-norm"])`` (layer-wise norms from
``fedaudit.privacy.primitive.per_sample_sq_norms``); "previous" is the code path
it replaced (torch.func per-sample gradients of the whole model, then their
norms); "opacus" is a forward and backward pass of a GradSampleModule per batch,
with the norms taken from ``grad_sample``. The ratios (their time / our time,
> 1 means we are faster) are what to compare across machines; the norms of all
three are checked to agree. "floor" is one forward and one backward pass of each
batch's summed loss, with no per-sample work at all: what any method must pay.

    python benchmarks/attack_signals.py [--examples 10000] [--batch 256] [--threads 1] [--device cpu] [--smoke]
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from _machine import describe
from opacus import GradSampleModule
from twins import convnet_and_opacus_twin

from fedaudit.attacks.membership.signals import compute_signals
from fedaudit.privacy.primitive import per_sample_gradients, per_sample_norms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def opacus_norms(
    gsm: GradSampleModule, x: torch.Tensor, y: torch.Tensor, batch: int, device: torch.device
) -> np.ndarray:
    """Per-example gradient norms from Opacus' hooks, batch by batch."""
    norms = []
    for start in range(0, len(y), batch):
        xb, yb = x[start : start + batch].to(device), y[start : start + batch].to(device)
        gsm.zero_grad(set_to_none=True)
        for p in gsm.parameters():
            p.grad_sample = None
        F.cross_entropy(gsm(xb), yb, reduction="sum").backward()
        squares = sum(p.grad_sample.flatten(start_dim=1).pow(2).sum(dim=1) for p in gsm.parameters() if p.requires_grad)
        norms.append(squares.sqrt().detach().cpu())
    return torch.cat(norms).to(torch.float64).numpy()


def previous_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, device: torch.device):
    """The signal's previous code path: every per-sample gradient of the model, then their norms, batch by batch."""
    model = model.eval().to(device)
    norms = [
        per_sample_norms(per_sample_gradients(model, x[i : i + batch].to(device), y[i : i + batch].to(device)))
        .detach()
        .cpu()
        for i in range(0, len(y), batch)
    ]
    return torch.cat(norms).to(torch.float64).numpy()


def floor_time(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, device: torch.device) -> float:
    """Seconds for a plain forward and backward pass of every batch (parameter gradients of the summed loss)."""
    model = model.eval().to(device)
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(y), batch):
        loss = F.cross_entropy(model(x[i : i + batch].to(device)), y[i : i + batch].to(device), reduction="sum")
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    _sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--smoke", action="store_true", help="smallest sizes (seconds): 64 examples, batches of 32, width 8"
    )
    args = parser.parse_args()
    if args.smoke:
        args.examples, args.batch, args.widths = 64, 32, [8]
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message="Full backward hook")
    print(describe(device), flush=True)
    print(
        f"torch {torch.__version__}, threads={torch.get_num_threads()}, device={device}, "
        f"{args.examples} examples, batch {args.batch}, input 1x28x28, ConvNet depth 3"
    )
    print(
        f"{'width':>5} {'ours (s)':>9} {'ours (ex/s)':>12} {'previous (s)':>13} {'opacus (s)':>11} "
        f"{'floor (s)':>10} {'previous/ours':>14} {'opacus/ours':>12} {'ours/floor':>11} {'max rel. diff':>14}"
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.examples, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (args.examples,), generator=generator)
    for width in args.widths:
        model, gsm = convnet_and_opacus_twin(width, device)
        warm = slice(0, args.batch)
        compute_signals(model, x[warm], y[warm], ["grad-norm"], batch_size=args.batch, device=device)
        opacus_norms(gsm, x[warm], y[warm], args.batch, device)
        previous_norms(model, x[warm], y[warm], args.batch, device)

        _sync(device)
        start = time.perf_counter()
        ours = compute_signals(model, x, y, ["grad-norm"], batch_size=args.batch, device=device).values["grad-norm"]
        _sync(device)
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        theirs = opacus_norms(gsm, x, y, args.batch, device)
        _sync(device)
        opacus_s = time.perf_counter() - start
        gsm._close()
        start = time.perf_counter()
        before = previous_norms(model, x, y, args.batch, device)
        _sync(device)
        previous_s = time.perf_counter() - start
        floor_s = floor_time(model, x, y, args.batch, device)

        diff = max(float(np.max(np.abs(ours - other) / np.maximum(np.abs(other), 1e-12))) for other in (theirs, before))
        print(
            f"{width:>5} {ours_s:>9.1f} {args.examples / ours_s:>12.0f} {previous_s:>13.1f} {opacus_s:>11.1f} "
            f"{floor_s:>10.1f} {previous_s / ours_s:>14.2f} {opacus_s / ours_s:>12.2f} {ours_s / floor_s:>11.2f} "
            f"{diff:>14.1e}"
        )


if __name__ == "__main__":
    main()

"""Shared by the benchmarks that measure fedaudit against Opacus: the paper's ConvNet and its Opacus twin.

Run as a script, it checks that the twins are twins: for each width, every example's gradient norm on one random
batch from fedaudit's ``per_sample_sq_norms`` on the ConvNet against the Opacus twin's ``grad_sample``.

    python benchmarks/twins.py [--widths 32 128] [--batch 64] [--smoke]
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from _machine import describe
from opacus import GradSampleModule
from torch import nn

from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy.primitive import per_sample_sq_norms


def convnet_and_opacus_twin(width: int, device: torch.device) -> tuple[nn.Module, GradSampleModule]:
    """The ConvNet (28x28 input, depth 3) and a GradSampleModule around an identical copy of it."""
    spec = ModelSpec("convnet", (1, 28, 28), 10, width=width, depth=3)
    torch.manual_seed(0)
    model = build_model(spec).to(device)
    reference = build_model(spec).to(device)
    reference.load_state_dict(model.state_dict())
    return model, GradSampleModule(reference, loss_reduction="sum")


def check(width: int, batch: int) -> tuple[int, float]:
    """The ConvNet's parameter count, and the largest relative difference between the twins' per-example gradient
    norms on one random batch (CPU)."""
    model, gsm = convnet_and_opacus_twin(width, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    ours = torch.stack(list(per_sample_sq_norms(model.eval(), x, y).values())).sum(dim=0).sqrt()
    F.cross_entropy(gsm(x), y, reduction="sum").backward()
    theirs = sum(p.grad_sample.flatten(start_dim=1).pow(2).sum(dim=1) for p in gsm.parameters() if p.requires_grad)
    gsm._close()
    difference = float(((ours - theirs.sqrt()).abs() / theirs.sqrt().clamp(min=1e-12)).max())
    return sum(p.numel() for p in model.parameters()), difference


def main() -> None:
    parser = argparse.ArgumentParser(description="Check that the ConvNet and its Opacus twin give the same gradients.")
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (seconds): width 8, a batch of 8")
    args = parser.parse_args()
    if args.smoke:
        args.widths, args.batch = [8], 8
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook")
    print(describe("cpu"), flush=True)
    print(f"{'width':>5} {'parameters':>10} {'batch':>5} {'max rel. diff':>14}")
    for width in args.widths:
        parameters, difference = check(width, args.batch)
        print(f"{width:>5} {parameters:>10} {args.batch:>5} {difference:>14.1e}")


if __name__ == "__main__":
    main()

"""Reconstruction from what crossed the wire: PSNR/SSIM of the records the server rebuilds, against batch size, local
steps and epsilon, for FedSGD and FedAvg on digits and Fashion-MNIST, and the nearest-record similarity of FedLAP-DP's
synthetic sets at the same budgets.

Gradient-sharing cells: a client of N records (drawn without replacement from the training split, disjoint between
clients) computes its round-1 update with fedaudit's own FedSGD or FedAvg (B records per step, E local epochs) from a
freshly initialised ConvNet (width 32), and the attack of ``fedaudit attack --method reconstruction`` inverts it
(``attack_update``: labels from the bias update, Inverting Gradients, local steps simulated), once on the update and
once on a random update of the same norm (its null). Under DP the noise multiplier is calibrated (RDP, delta 1e-5) so
that this one round spends epsilon: the whole budget on the one update the server sees, the attacker's best case at
that epsilon. Records are pooled over the clients of a cell; each number has its 95% interval over the records.

FedLAP-DP cells: ``fedaudit train --algorithm fedlap --dp --target-epsilon E --save-transmitted`` on digits (5
clients, 2 rounds, width 32), then ``fedaudit attack --method reconstruction``: every synthetic image against its
client's nearest record, beside held-out real records (the null).

    python benchmarks/reconstruction.py [--datasets digits fashion-mnist] [--iterations 250] [--restarts 4]
        [--out DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _machine import add_program_option, describe, fedaudit_command, use_program

from fedaudit.algorithms.base import ClientData, RoundContext
from fedaudit.algorithms.fedavg import FedAvg, FedSGD
from fedaudit.attacks.options import DEFAULT_PSNR_THRESHOLD, ReconstructionOptions
from fedaudit.attacks.reconstruction.attack import LocalTraining, _random_like, attack_update
from fedaudit.attacks.reconstruction.image_quality import assign, pair_quality, pixel_range, quality_summary, to_pixels
from fedaudit.config import RunConfig
from fedaudit.data import load_dataset, locate_dataset
from fedaudit.models import ModelSpec, build_model, default_depth
from fedaudit.privacy.accounting import calibrate_noise_multiplier
from fedaudit.privacy.randomness import QueryDraws, SeededKeys
from fedaudit.reports.collect import collect_run

WIDTH = 32
EPSILONS = (None, 8.0, 4.0, 1.0)
RECORDS_PER_CELL = 8  # records pooled per cell at least (clients of B records: ceil(8 / B) of them)
SMOKE_RECORDS_PER_CELL = 2  # --smoke: still two clients pooled where B = 1, and an interval over the records


@dataclass(frozen=True)
class Cell:
    """One setting: the algorithm, records per client N, batch size B, local epochs E, and epsilon (None: no DP)."""

    dataset: str
    algorithm: str
    records: int
    batch: int
    epochs: int
    epsilon: float | None

    @property
    def steps(self) -> int:
        return 1 if self.algorithm == "fedsgd" else self.epochs * max(1, self.records // self.batch)


def grid(datasets: list[str], smoke: bool) -> list[Cell]:
    """The cells: batch sizes (no DP), local steps (FedAvg, no DP) and epsilon (B = 1), per dataset."""
    cells: list[Cell] = []
    batches = (1, 4) if smoke else (1, 4, 16, 64)
    epsilons = (None, 1.0) if smoke else EPSILONS
    for dataset in datasets:
        for algorithm in ("fedsgd", "fedavg"):
            cells += [Cell(dataset, algorithm, b, b, 2, None) for b in batches]
        if not smoke:
            cells += [Cell(dataset, "fedavg", 4, 4, e, None) for e in (1, 5)]
            cells.append(Cell(dataset, "fedavg", 8, 4, 2, None))  # two batches per epoch: Dimitrov's epoch copies
        for algorithm in ("fedsgd", "fedavg"):
            cells += [Cell(dataset, algorithm, 1, 1, 2, eps) for eps in epsilons if eps is not None]
    return cells


def run_cell(cell: Cell, data: dict, options: ReconstructionOptions, seed: int, pooled: int = RECORDS_PER_CELL) -> dict:
    """Every client of one cell attacked (and its null); at least ``pooled`` records pooled."""
    dataset = data[cell.dataset]
    shape = tuple(dataset.train_x.shape[1:])
    spec = ModelSpec("convnet", shape, dataset.num_classes, WIDTH, default_depth("convnet", shape))
    torch.manual_seed(seed)
    model = build_model(spec)
    model.eval()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    overrides = {
        "data.dataset": cell.dataset,
        "federated.algorithm": cell.algorithm,
        "federated.batch_size": cell.batch,
        "federated.local_epochs": cell.epochs,
        "federated.lr_schedule": "constant",
    }
    sigma = None
    if cell.epsilon is not None:
        sigma = calibrate_noise_multiplier(
            target_epsilon=cell.epsilon, sample_rate=1.0, queries_per_round=cell.steps, rounds=1, delta=1e-5
        )
        overrides.update({"privacy.dp": True, "privacy.noise_multiplier": sigma})
    config = RunConfig().with_overrides(overrides).resolved()
    algorithm = (FedSGD if cell.algorithm == "fedsgd" else FedAvg)(config)
    context = RoundContext(round=0, rounds=1, config=config, device=torch.device("cpu"))
    training = LocalTraining(
        steps=cell.steps,
        batch_size=cell.batch,
        lr=config.federated.client_lr,
        momentum=config.federated.momentum,
        full_batch=cell.algorithm == "fedsgd" and cell.epsilon is None,
        max_grad_norm=config.privacy.max_grad_norm if cell.epsilon is not None else None,
    )
    box = pixel_range(dataset.train_x)
    low, high = box
    clients = math.ceil(pooled / cell.records)
    order = np.random.default_rng(seed).permutation(len(dataset.train_y))
    psnrs, ssims, null_psnrs, null_ssims, right, seconds = [], [], [], [], 0, []
    for k in range(clients):
        index = torch.from_numpy(order[k * cell.records : (k + 1) * cell.records].copy())
        x, y = dataset.train_x[index], dataset.train_y[index]
        generator = torch.Generator().manual_seed(seed * 1000 + k)
        data = ClientData(k, x, y, draws=QueryDraws(SeededKeys(seed * 1000 + k, k), 0, torch.device("cpu")))
        update = algorithm.client_update(build_model(spec), start, data, context, generator).payload
        rebuilt = []
        for purpose, received in ((0, update), (1, _random_like(update, generator))):
            began = time.perf_counter()
            inversion = attack_update(
                model,
                start,
                received,
                training,
                unknown=cell.records,
                known=None,
                num_classes=dataset.num_classes,
                box=box,
                shape=shape,
                options=options,
                generator=generator,
            )
            if purpose == 0:
                seconds.append(time.perf_counter() - began)
            rebuilt.append(inversion)
        reals = to_pixels(x, low, high)
        for inversion, p_list, s_list in ((rebuilt[0], psnrs, ssims), (rebuilt[1], null_psnrs, null_ssims)):
            guesses = to_pixels(inversion.images, low, high)
            p, s = pair_quality(guesses, reals[assign(guesses, reals)])
            p_list += list(p)
            s_list += list(s)
        counts = np.bincount(rebuilt[0].labels.numpy(), minlength=dataset.num_classes)
        right += int(np.minimum(counts, np.bincount(y.numpy(), minlength=dataset.num_classes)).sum())
    threshold = options.psnr_threshold
    return {
        "quality": quality_summary(np.array(psnrs), np.array(ssims), threshold),
        "null": quality_summary(np.array(null_psnrs), np.array(null_ssims), threshold),
        "labels": f"{right}/{len(psnrs)}",
        "sigma": sigma,
        "seconds": float(np.mean(seconds)),
    }


def fedlap_cells(out: Path, epsilons: tuple[float | None, ...], smoke: bool) -> list[tuple[str, dict, float]]:
    """FedLAP(-DP) trained at each budget on digits and attacked: the last round's pooled numbers."""
    rows = []
    for eps in epsilons:
        run = out / f"fedlap-{'nodp' if eps is None else f'eps{eps:g}'}"
        budget = [] if eps is None else ["--dp", "--target-epsilon", f"{eps:g}"]
        small = ["--ipc", "2", "--max-loops", "1", "--real-batches", "1", "--server-epochs", "1"] if smoke else []
        train = [
            *("train --dataset digits --algorithm fedlap --rounds 2 --save-transmitted --device cpu").split(),
            *("--no-progress", "--width", "8" if smoke else str(WIDTH), "--out", str(run), "--overwrite"),
            *budget,
            *small,
        ]
        began = time.perf_counter()
        for argv in (train, ["attack", str(run), "--method", "reconstruction", "--device", "cpu", "--no-progress"]):
            done = subprocess.run([*fedaudit_command(), *argv], capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"fedaudit {argv[0]} failed: {done.stderr[-2000:]}")
        last = collect_run(run).reconstruction_rounds[-1]
        label = "none" if eps is None else f"{eps:g}"
        rows.append((label, {"quality": last.quality, "null": last.null_quality}, time.perf_counter() - began))
    return rows


def nearest_other(dataset, records: int = 300, pool: int = 5000) -> np.ndarray:
    """PSNR of each of the first ``records`` training records against the closest other record of its class among
    the first ``pool``: what a different real image reaches (why 20 dB is the threshold)."""
    x, y = dataset.train_x[:pool], dataset.train_y[:pool]
    low, high = pixel_range(dataset.train_x)
    flat = to_pixels(x, low, high).reshape(len(y), -1)
    found = []
    for i in range(min(records, len(y))):
        same = (y == y[i]).numpy()
        same[i] = False
        errors = ((flat[same] - flat[i]) ** 2).mean(1)
        found.append(10 * np.log10(1.0 / errors.min()))
    return np.array(found)


def cell_text(summary: dict, digits: int = 2) -> str:
    if summary["mean"] is None:
        return "-"
    ci = summary["ci95"]
    return f"{summary['mean']:.{digits}f}" + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")


def recovered_text(recovered: dict) -> str:
    ci = recovered["ci95"]
    return f"{recovered['recovered']}/{recovered['n']} [{ci[0]:.2f}, {ci[1]:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"])
    parser.add_argument("--iterations", type=int, default=ReconstructionOptions().iterations)
    parser.add_argument("--restarts", type=int, default=ReconstructionOptions().restarts)
    parser.add_argument("--out", type=Path, help="where the FedLAP runs go [default: a temporary directory]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits, B 1 and 4, no DP and epsilon 1, 2 records pooled per cell, 10 "
        "iterations; FedLAP-DP at epsilon 1",
    )
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    torch.set_num_threads(1)
    if args.smoke:
        args.datasets, args.iterations, args.restarts = ["digits"], 10, 1
    datasets = [name for name in args.datasets if name == "digits" or locate_dataset(name) is not None]
    skipped = sorted(set(args.datasets) - set(datasets))
    options = ReconstructionOptions(iterations=args.iterations, restarts=args.restarts)
    began = time.perf_counter()
    data = {name: load_dataset(name) for name in datasets}
    print(describe("cpu", 1), flush=True)
    print(
        f"reconstruction from one round-1 update: ConvNet width {WIDTH}, {args.iterations} iterations x "
        f"{args.restarts} starts, recovered at PSNR >= {DEFAULT_PSNR_THRESHOLD:g} dB, {torch.get_num_threads()} torch "
        f"thread(s); 95% intervals over the records"
        + (f"; not found, left out: {', '.join(skipped)}" if skipped else "")
    )
    header = (
        f"{'dataset':<14}{'algorithm':<10}{'N':>4}{'B':>4}{'E':>3}{'eps':>6}{'sigma':>8}{'n':>4}  "
        f"{'PSNR dB [95%]':<22}{'SSIM [95%]':<24}{'recovered [95%]':<20}{'null PSNR dB [95%]':<22}"
        f"{'labels':<8}{'s/attack':>8}"
    )
    for name in datasets:
        closest = nearest_other(data[name], 50 if args.smoke else 300)
        print(
            f"{name}: the closest other record of the same class (first {min(5000, len(data[name].train_y))} "
            f"training records) reaches a median {np.median(closest):.2f} dB, 90th percentile "
            f"{np.quantile(closest, 0.9):.2f} dB, over {len(closest)} records"
        )
    print(header)
    for cell in grid(datasets, args.smoke):
        result = run_cell(cell, data, options, args.seed, SMOKE_RECORDS_PER_CELL if args.smoke else RECORDS_PER_CELL)
        q = result["quality"]
        eps = "none" if cell.epsilon is None else f"{cell.epsilon:g}"
        sigma = "-" if result["sigma"] is None else f"{result['sigma']:.3f}"
        print(
            f"{cell.dataset:<14}{cell.algorithm:<10}{cell.records:>4}{cell.batch:>4}{cell.epochs:>3}"
            f"{eps:>6}{sigma:>8}{q['psnr']['n']:>4}  "
            f"{cell_text(q['psnr']):<22}{cell_text(q['ssim'], 3):<24}{recovered_text(q['recovered']):<20}"
            f"{cell_text(result['null']['psnr']):<22}{result['labels']:<8}{result['seconds']:>8.1f}",
            flush=True,
        )
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out if args.out is not None else Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        epsilons = (1.0,) if args.smoke else EPSILONS
        print("\nFedLAP(-DP) synthetic sets on digits (last round, every client): nearest real record of the client")
        print(
            f"{'eps':>6}{'n':>5}  {'PSNR dB [95%]':<22}{'SSIM [95%]':<24}{'recovered [95%]':<20}"
            f"{'held-out PSNR dB [95%]':<24}{'s (train+attack)':>16}"
        )
        for label, result, seconds in fedlap_cells(out, epsilons, args.smoke):
            q = result["quality"]
            print(
                f"{label:>6}{q['psnr']['n']:>5}  {cell_text(q['psnr']):<22}{cell_text(q['ssim'], 3):<24}"
                f"{recovered_text(q['recovered']):<20}{cell_text(result['null']['psnr']):<24}{seconds:>16.1f}",
                flush=True,
            )
    print(f"\nrun time {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()

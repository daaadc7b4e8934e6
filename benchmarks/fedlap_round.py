"""One FedLAP-DP client round vs one DP-FedAvg client round at equal data access, and where the time goes.

Both clients make the same number of DP queries (T = R_i * L * R_b; DP-FedAvg runs
``--local-steps T``) with the same sigma, batch size and data (one client of the
paper's Fashion-MNIST split, 5 clients x 2 classes; random 28x28 data of the same
size if Fashion-MNIST is not installed; digits with --smoke). The FedLAP-DP time
is split into the DP queries (per-sample gradients, clip, noise), the second-order
matching steps, the model training on the synthetic set, and the server's
training on the union.

    python benchmarks/fedlap_round.py [--widths 32 128] [--trajectories 4] [--augment] [--threads 1] [--device cuda]
        [--profile profile.txt] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from _machine import describe

import fedaudit.algorithms.fedlap as fedlap_module
from fedaudit.algorithms.base import ClientData, RoundContext, get_algorithm
from fedaudit.algorithms.fedlap import FedLAP
from fedaudit.config import DataConfig, FederatedConfig, FedLAPConfig, PrivacyConfig, RunConfig
from fedaudit.cuda_graph import GRAPHS_ENV
from fedaudit.data import DataError, load_dataset, partition_dataset
from fedaudit.models import ModelSpec, build_model, default_depth
from fedaudit.privacy.randomness import QueryDraws, SeededKeys


def _client_data(name: str = "fashion-mnist") -> tuple[ClientData, str]:
    """Client 0 of ``name`` (5 clients x 2 classes) and its description; random data if Fashion-MNIST is missing."""
    try:
        dataset = load_dataset(name)
        partition = partition_dataset(
            dataset.train_y.numpy(), num_clients=5, scheme="classes:2", seed=0, holdout_fraction=0.1
        )
        idx = torch.from_numpy(partition.clients[0].copy())
        title = {"fashion-mnist": "Fashion-MNIST"}.get(name, name)
        return ClientData(0, dataset.train_x[idx], dataset.train_y[idx]), f"{title} client 0"
    except DataError:
        if name != "fashion-mnist":
            raise
        generator = torch.Generator().manual_seed(0)
        n = 10800
        x = torch.randn(n, 1, 28, 28, generator=generator)
        return ClientData(0, x, torch.arange(n) % 2), "random 28x28 data (Fashion-MNIST not installed)"


class Stopwatch:
    """Accumulates the wall time spent inside wrapped functions (on a GPU, until their kernels have finished)."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += self.now() - start

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    parser.add_argument(
        "--trajectories", type=int, default=4, help="R_i (4 in the authors' DP config); fewer for a quicker run"
    )
    parser.add_argument(
        "--augment",
        action="store_true",
        help="DSA augmentation of real and synthetic batches, as the authors' code does",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every figure is of this device)")
    parser.add_argument(
        "--profile",
        type=Path,
        help="also profile one FedLAP-DP client round per width with torch.profiler and write its operator tables "
        "(by device time and by host time) and the accelerator's busy share to this file",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits (8x8, ConvNet depth 2) instead of Fashion-MNIST, width 8, "
        "R_i = L = R_b = J = 1 (T = 1), 1 image per class, 1 server epoch",
    )
    args = parser.parse_args()
    if args.smoke:
        args.widths, args.trajectories = [8], 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(describe(device), flush=True)
    data, source = _client_data("digits" if args.smoke else "fashion-mnist")
    # the client's DP queries draw from keys of a public seed, as a --noise-seed run's would (the cost is the same)
    data = ClientData(
        0, data.x.to(device), data.y.to(device), draws=QueryDraws(SeededKeys(1, 0), 0, torch.device(device))
    )
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, data: {source}, N_k={data.num_examples}")
    data_config = DataConfig(dataset="fashion-mnist")  # its defaults: B = 256, the paper's learning rates
    loops = FedLAPConfig(trajectories=args.trajectories, augment=args.augment)
    if args.smoke:
        loops = replace(loops, max_loops=1, real_batches=1, image_steps=1, ipc=1, server_epochs=1)
    lap = RunConfig(
        data=data_config,
        federated=FederatedConfig(algorithm="fedlap", rounds=1),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0),
        fedlap=loops,
    ).resolved()
    assert lap.federated.batch_size == 256, lap.federated.batch_size
    queries = FedLAP().queries_per_round(lap, data.num_examples)
    avg = RunConfig(
        data=data_config,
        federated=FederatedConfig(algorithm="fedavg", rounds=1, local_steps=queries),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0),
    ).resolved()
    f = lap.fedlap
    print(
        f"FedLAP-DP: R_i={f.trajectories}, L={f.max_loops}, R_b={f.real_batches}, J={f.image_steps}, ipc={f.ipc}, "
        f"B=256, sigma=1, C=1, augment={args.augment}; "
        f"DP-FedAvg: the same number of DP queries (--local-steps), B=256, sigma=1, C=0.1"
    )
    header = (
        f"{'width':>5} {'T':>4} {'DP-FedAvg (s)':>14} {'FedLAP-DP (s)':>14} {'ratio':>6} "
        f"{'DP queries':>11} {'matching':>9} {'syn. training':>14} {'server (s)':>11}"
    )
    print(header)
    for width in args.widths:
        shape = tuple(data.x.shape[1:])
        spec = ModelSpec("convnet", shape, 10, width=width, depth=default_depth("convnet", shape))
        torch.manual_seed(0)
        model = build_model(spec).to(device)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}

        watch = Stopwatch(device)
        originals = (fedlap_module.dp_gradient, FedLAP._image_step, fedlap_module.fit_in_ball)
        fedlap_module.dp_gradient = watch.wrap("dp", originals[0])
        FedLAP._image_step = watch.wrap("matching", originals[1])
        fedlap_module.fit_in_ball = watch.wrap("training", originals[2])
        try:
            algorithm = get_algorithm(lap)
            ctx = RoundContext(round=0, rounds=1, config=lap, device=device)
            start = watch.now()
            message = algorithm.client_update(model, params, data, ctx, torch.Generator(device).manual_seed(1))
            lap_seconds = watch.now() - start
            client_training = watch.seconds["training"]
            start = watch.now()
            algorithm.server_update(model, params, [message] * 5, ctx, torch.Generator(device).manual_seed(2))
            server_seconds = watch.now() - start
        finally:
            fedlap_module.dp_gradient, FedLAP._image_step, fedlap_module.fit_in_ball = originals

        fedavg = get_algorithm(avg)
        ctx = RoundContext(round=0, rounds=1, config=replace(avg), device=device)
        start = watch.now()
        fedavg.client_update(model, params, data, ctx, torch.Generator(device).manual_seed(1))
        avg_seconds = watch.now() - start

        def share(name: str) -> str:
            return f"{watch.seconds[name]:.1f}s {100 * watch.seconds[name] / lap_seconds:.0f}%"

        print(
            f"{width:>5} {queries:>4} {avg_seconds:>14.1f} {lap_seconds:>14.1f} {lap_seconds / avg_seconds:>6.2f} "
            f"{share('dp'):>11} {share('matching'):>9} "
            f"{f'{client_training:.1f}s {100 * client_training / lap_seconds:.0f}%':>14} {server_seconds:>11.1f}"
        )

        def client_round(model=model, params=params) -> None:
            """One FedLAP-DP client round, without timers, with the randomness of the timed one."""
            ctx = RoundContext(round=0, rounds=1, config=lap, device=device)
            get_algorithm(lap).client_update(model, params, data, ctx, torch.Generator(device).manual_seed(1))

        if device.type == "cuda":
            compare_graphs(client_round, device, width)
        if args.profile is not None:
            profile_round(client_round, device, width, args.profile)


def compare_graphs(client_round: Callable[[], None], device: torch.device, width: int) -> None:
    """One FedLAP-DP client round with its image steps replayed as a CUDA graph and one with them eager (the previous
    path, FEDAUDIT_CUDA_GRAPHS=0); prints both and their ratio. The environment is left as it was."""
    before, seconds = os.environ.get(GRAPHS_ENV), {}
    try:
        for mode in ("1", "0"):
            os.environ[GRAPHS_ENV] = mode
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            client_round()
            torch.cuda.synchronize(device)
            seconds[mode] = time.perf_counter() - start
    finally:
        if before is None:
            del os.environ[GRAPHS_ENV]
        else:
            os.environ[GRAPHS_ENV] = before
    graphed, eager = seconds["1"], seconds["0"]
    print(
        f"width {width}: FedLAP-DP client round without timers: image steps replayed as a CUDA graph "
        f"{graphed:.2f} s, eager ({GRAPHS_ENV}=0) {eager:.2f} s: eager/graph {eager / graphed:.2f}",
        flush=True,
    )


def profile_round(client_round: Callable[[], None], device: torch.device, width: int, out: Path) -> None:
    """One FedLAP-DP client round under torch.profiler: its operators by device and by host time, appended to
    ``out``, and the share of the round's wall time in which the device ran kernels (what host work leaves idle)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        client_round()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    kernel_us = sum(e.self_device_time_total for e in kernels)  # the kernels' rows alone: operators' rows repeat them
    line = (
        f"width {width}: profiled client round {wall:.1f} s wall (with the profiler's overhead), device kernels "
        f"{kernel_us / 1e6:.2f} s = {100 * kernel_us / 1e6 / wall:.0f}% busy, {sum(e.count for e in kernels)} kernels"
    )
    print(line, flush=True)
    with out.open("a") as handle:
        handle.write(f"{line}\n\n")
        if device.type == "cuda":
            handle.write(events.table(sort_by="self_device_time_total", row_limit=30) + "\n")
        handle.write(events.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")


if __name__ == "__main__":
    main()

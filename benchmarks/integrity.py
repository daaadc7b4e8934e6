"""What tamper evidence costs: a round's two-phase commit against the plain writes of the same bytes (the code path
before hashing), and the check of a whole run against merely reading its files.

A DP-FedAvg run with --save-transmitted is trained once (digits, ConvNet, K clients); then, on its files:
- commit: every file of its last round written through ``RunDirectory.staged`` (hashes, pending manifest, files,
  committed manifest) against ``atomic_write_bytes`` of the same bytes and one manifest write;
- check: ``RunDirectory.seal.problems`` (every file hashed, the ledger replayed from cold, as in a fresh
  ``fedaudit report``) against reading every file.
Times are the median of --repeats runs, one thread.

    python benchmarks/integrity.py [--clients 10] [--rounds 5] [--width 32] [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _machine import describe

from fedaudit.config import DataConfig, FederatedConfig, ModelConfig, PrivacyConfig, RunConfig
from fedaudit.privacy import accounting
from fedaudit.rundir import RunDirectory, atomic_write_bytes, atomic_write_json
from fedaudit.training import train


def _median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes: 2 clients, 2 rounds, width 8, 1 repeat")
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.rounds, args.width, args.repeats = 2, 2, 8, 1
    torch.set_num_threads(1)
    config = RunConfig(
        device="cpu",
        save_transmitted=True,
        data=DataConfig(dataset="digits", num_clients=args.clients, partition="iid"),
        model=ModelConfig(arch="convnet", width=args.width),
        federated=FederatedConfig(algorithm="fedavg", rounds=args.rounds, local_epochs=1),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0, max_grad_norm=1.0),
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run"
        train(config, path, progress=False, echo=lambda _line: None)
        run = RunDirectory(path)
        last = f"round-{args.rounds:04d}"
        files = [
            p
            for p in path.rglob("*")
            if p.is_file() and (last in p.as_posix() or p.name in ("model.safetensors", "metrics.csv", "privacy.json"))
        ]
        contents = {p: p.read_bytes() for p in files}
        manifest = run.read_manifest()
        every = [p for p in path.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in every)

        def hashed_commit() -> None:
            writer = RunDirectory(path)
            with writer.staged():
                for p, data in contents.items():
                    writer.put(p, data)
                writer.write_manifest(manifest)

        def plain_commit() -> None:
            for p, data in contents.items():
                atomic_write_bytes(p, data)
            atomic_write_json(path / "manifest.json", RunDirectory(path).read_json(path / "manifest.json"))

        def read_all() -> None:
            for p in every:
                p.read_bytes()

        assert not run.seal.problems()
        commit, plain = _median(hashed_commit, args.repeats), _median(plain_commit, args.repeats)

        def cold_check() -> None:  # as in a fresh `fedaudit report`: no epsilon computed yet in this process
            accounting._epsilon_cached.cache_clear()
            run.seal.problems()

        check, read = _median(cold_check, args.repeats), _median(read_all, args.repeats)
    round_bytes = sum(len(d) for d in contents.values())
    print(describe("cpu"), flush=True)
    print(f"digits DP-FedAvg, {args.clients} clients, {args.rounds} rounds, ConvNet width {args.width}, 1 thread")
    print(f"{'what':<42} {'hashed':>10} {'reference':>10} {'ratio':>7}")
    print(
        f"{'commit one round (' + str(len(contents)) + f' files, {round_bytes / 1e6:.2f} MB)':<42} "
        f"{commit * 1e3:>8.1f}ms {plain * 1e3:>8.1f}ms {commit / plain:>7.2f}"
    )
    print(
        f"{'check the run (' + str(len(every)) + f' files, {size / 1e6:.2f} MB)':<42} "
        f"{check * 1e3:>8.1f}ms {read * 1e3:>8.1f}ms {check / read:>7.2f}"
    )
    print("reference: the same bytes written with atomic_write_bytes and one manifest write; reading every file")


if __name__ == "__main__":
    main()

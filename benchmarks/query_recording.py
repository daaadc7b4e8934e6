"""What recording a canary run's DP queries adds to a DP-FedAvg client round.

One process sets up the run as ``fedaudit train --dp --noise-multiplier 1 --canaries M --local-epochs 1`` would
(5 clients x 2 classes, ConvNet, M gradient canaries) and times one client's round two ways on the same
:class:`ClientData`, canaries included:

- with recording: the canary run's path, ``run_client`` with ``data.audit`` set, which hands the DP primitive a
  :class:`fedaudit.instruments.queries.QueryLog` (each released sum projected on every canary of the client, a few whole
  queries kept) and gathers the log's arrays into the message;
- without: the same data with ``audit=None``, the code path before the query log.

The two alternate (A B A B ...) after one untimed warm-up of each, every round from the same global model and the
same client generator, so both do the same training; the script checks that both send the same update. It prints
the median seconds of each, their ratio (with / without) and the overhead in percent.

    python benchmarks/query_recording.py [--dataset fashion-mnist] [--client 0] [--canaries 5000] [--width 32]
                                         [--local-epochs 1] [--repeats 5] [--threads 1] [--smoke]
    python benchmarks/query_recording.py --dataset digits --repeats 1   # a quick check
    python benchmarks/query_recording.py --smoke                        # the quickest check
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch
from _machine import describe

from fedaudit.algorithms.base import ClientData, ClientMessage, RoundContext, run_client
from fedaudit.config import AuditConfig, DataConfig, FederatedConfig, ModelConfig, PrivacyConfig, RunConfig
from fedaudit.data import DataError
from fedaudit.models import build_model, initial_params
from fedaudit.preparation import Setup, client_data, prepare
from fedaudit.privacy.randomness import SeededKeys

ROUNDS = 10  # the run's rounds: they set how often a round keeps whole queries (--kept-queries per run on average)


def run_config(args: argparse.Namespace, dataset: str) -> RunConfig:
    """The run of ``fedaudit train --dp --noise-multiplier 1 --canaries M`` with this script's options."""
    return RunConfig(
        device="cpu",
        data=DataConfig(dataset=dataset, partition="classes:2", num_clients=5),
        model=ModelConfig(arch="convnet", width=args.width),
        federated=FederatedConfig(algorithm="fedavg", rounds=ROUNDS, local_epochs=args.local_epochs),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0),
        audit=AuditConfig(canaries=args.canaries, canary_kind="gradient"),
    )


def set_up(args: argparse.Namespace) -> tuple[Setup, str]:
    """The prepared run, on the dataset asked for or, when Fashion-MNIST is not installed, on digits (and a note)."""
    try:
        return prepare(run_config(args, args.dataset)), ""
    except DataError as error:
        if args.dataset != "fashion-mnist":
            raise
        return prepare(run_config(args, "digits")), f" (Fashion-MNIST is not installed, so digits: {error})"


def timed_round(setup: Setup, data: ClientData, round_index: int) -> tuple[float, ClientMessage]:
    """Seconds of one client round from the run's initial model, with the client's generator of ``round_index``."""
    config, device = setup.config, setup.device
    model = build_model(setup.spec).to(device)
    params = {name: p.to(device) for name, p in initial_params(setup.spec, config.seed).items()}
    ctx = RoundContext(round=round_index, rounds=config.federated.rounds, config=config, device=device)
    keys = SeededKeys(config.seed, data.client_id)  # the same draws on both paths
    start = time.perf_counter()
    message = run_client(setup.algorithm, model, params, data, ctx, keys)
    return time.perf_counter() - start, message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--client", type=int, default=0)
    parser.add_argument("--round", type=int, default=0, help="the round timed (0-based)")
    parser.add_argument("--canaries", type=int, default=5000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds of each path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits, 100 canaries, width 8, 1 local epoch, 1 repeat",
    )
    args = parser.parse_args()
    if args.smoke:
        args.dataset, args.canaries, args.width, args.local_epochs, args.repeats = "digits", 100, 8, 1, 1
    torch.set_num_threads(args.threads)
    setup, note = set_up(args)
    recording = client_data(setup, args.client)
    if recording.audit is None:
        raise SystemExit("The client has no query audit: the run has no canaries.")
    plain = replace(recording, audit=None)
    audit = recording.audit
    kept = sorted(audit.log(args.client, args.round, setup.device).kept_steps)
    fed = setup.config.federated
    print(describe(setup.device), flush=True)
    print(
        f"{setup.config.data.dataset}{note}: client {args.client} of 5 (2 classes), {recording.num_examples} records, "
        f"{setup.queries[args.client]} DP queries (batch {fed.batch_size}, {fed.local_epochs} local epoch(s)), "
        f"sigma {setup.config.privacy.noise_multiplier:g}, C {setup.config.privacy.max_grad_norm:g}"
    )
    print(
        f"convnet width {args.width}, {args.canaries} gradient canaries: the client's {len(audit.canaries)} projected "
        f"per query, {recording.num_canaries} in its data; round {args.round} keeps whole queries {kept or 'none'}"
    )
    print(
        f"torch {torch.__version__}, device {setup.device}, threads {torch.get_num_threads()}, "
        f"CPUs allowed {sorted(os.sched_getaffinity(0))}"
    )
    paths = {"with recording": recording, "without": plain}
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    sent: dict[str, ClientMessage] = {}
    for repeat in range(args.repeats + 1):
        for name, data in paths.items():
            took, sent[name] = timed_round(setup, data, args.round)
            if repeat:  # the first of each is a warm-up
                seconds[name].append(took)
    with_log, without = sent["with recording"], sent["without"]
    difference = max(float((with_log.payload[k] - without.payload[k]).abs().max()) for k in without.payload)
    print(f"the same update with and without recording: {difference == 0} (max |difference| {difference:.3g})")
    print(f"{'path':<15} {'median (s)':>10} {'min (s)':>8} {'max (s)':>8}  rounds (s)")
    for name, values in seconds.items():
        rounds = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:<15} {statistics.median(values):>10.2f} {min(values):>8.2f} {max(values):>8.2f}  {rounds}")
    ratio = statistics.median(seconds["with recording"]) / statistics.median(seconds["without"])
    print(f"ratio with / without recording (medians): {ratio:.3f}, overhead {100 * (ratio - 1):+.1f}%")


if __name__ == "__main__":
    main()
